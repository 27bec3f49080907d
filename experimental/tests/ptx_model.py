"""A numpy model of the few PTX instructions qpage's inline assembly uses, to run that
assembly on CPU, where Triton's interpreter cannot (tests only).

Each instruction is executed on whole numpy arrays (one element per GPU thread's
invocation), with the PTX ISA's semantics: ``lop3.b32`` by its lookup table, the fp16 and
fp16x2 arithmetic rounded to nearest even once per instruction (``fma`` fused), ``cvt``
exact or rounding to nearest even. Anything outside this subset raises, so a kernel that
starts using another instruction fails its test until the model learns it.
"""

from __future__ import annotations

import re

import numpy as np

F16X2_OPS = {"sub": lambda a, b: a - b, "add": lambda a, b: a + b, "mul": lambda a, b: a * b}


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two fp16 of 32-bit words, as float64."""
    v = v.astype(np.uint32)
    lo = (v & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (v >> 16).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float64 arrays rounded to fp16 (nearest even) in one 32-bit word, ``lo`` low."""
    lo_bits = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
    hi_bits = hi.astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo_bits | (hi_bits << 16)


def _e4m3(code: np.ndarray) -> np.ndarray:
    """e4m3 (``float8_e4m3fn``) codes -> float64 values from the format's definition (1-4-3,
    bias 7, subnormals at exponent 0; exponent and mantissa all ones is NaN)."""
    code = code.astype(np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    return np.where((code & 0x7F) == 0x7F, np.nan, sign * value)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of ``lut``."""
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.uint32)
    for index in range(8):
        if lut >> index & 1:
            pick_a = a if index & 4 else ~a
            pick_b = b if index & 2 else ~b
            pick_c = c if index & 1 else ~c
            out |= pick_a & pick_b & pick_c
    return out


def run_ptx(text: str, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Executes ``text`` (a Triton ``inline_asm_elementwise`` body) with ``$n`` operands taken
    from ``inputs`` (uint32 arrays for ``r`` registers, float32 for ``f``); returns every
    ``$n`` written."""
    regs: dict[str, np.ndarray] = {f"${n}": v for n, v in inputs.items()}
    written: dict[int, np.ndarray] = {}

    def val(token: str) -> np.ndarray:
        token = token.strip()
        if token in regs:
            return regs[token]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", token):
            return np.uint32(int(token, 0))
        raise ValueError(f"unknown operand {token!r}")

    def put(dest: str, value: np.ndarray) -> None:
        regs[dest] = value
        if dest.startswith("$"):
            written[int(dest[1:])] = value

    for raw in text.split(";"):
        line = raw.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        parts = op.split(".")
        if op == "mov.b32" and args[0].startswith("{"):
            lo_name, hi_name = (t.strip() for t in args[0].strip("{}").split(","))
            word = val(args[1]).astype(np.uint32)
            put(lo_name, (word & 0xFFFF).astype(np.uint16))
            put(hi_name, (word >> 16).astype(np.uint16))
        elif op == "mov.b32":
            put(args[0], np.asarray(val(args[1]), dtype=np.uint32))
        elif op == "lop3.b32":
            a, b, c = (np.asarray(val(t), dtype=np.uint32) for t in args[1:4])
            put(args[0], _lop3(a, b, c, int(args[4], 0)))
        elif op == "and.b32":
            put(args[0], np.asarray(val(args[1]), dtype=np.uint32) & np.asarray(val(args[2]), dtype=np.uint32))
        elif op == "prmt.b32":  # default mode: result byte i = byte (selector nibble i) of {b, a}
            a, b = (np.asarray(val(t), dtype=np.uint64) for t in args[1:3])
            pool = (b << np.uint64(32)) | a
            sel = int(args[3], 0)
            out = np.zeros(np.broadcast(a, b).shape, dtype=np.uint32)
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                if nib & 8:
                    raise NotImplementedError("prmt sign-replicating selectors")
                out |= (((pool >> np.uint64(8 * nib)) & np.uint64(0xFF)).astype(np.uint32) << np.uint32(8 * i))
            put(args[0], out)
        elif op == "shr.u32":
            put(args[0], np.asarray(val(args[1]), dtype=np.uint32) >> np.uint32(int(args[2], 0)))
        elif parts[0] in F16X2_OPS and parts[-1] == "f16x2" and "rn" in parts:
            (a_lo, a_hi), (b_lo, b_hi) = _halves(val(args[1])), _halves(val(args[2]))
            fn = F16X2_OPS[parts[0]]
            put(args[0], _pack(fn(a_lo, b_lo), fn(a_hi, b_hi)))
        elif op == "fma.rn.f16x2":
            (a_lo, a_hi), (b_lo, b_hi), (c_lo, c_hi) = (_halves(val(t)) for t in args[1:4])
            put(args[0], _pack(a_lo * b_lo + c_lo, a_hi * b_hi + c_hi))
        elif op == "add.rn.f16":
            a, b = (val(t).view(np.float16).astype(np.float64) for t in args[1:3])
            put(args[0], (a + b).astype(np.float16).view(np.uint16))
        elif op == "cvt.f32.f16":
            put(args[0], val(args[1]).view(np.float16).astype(np.float32))
        elif op == "cvt.rn.f16x2.e4m3x2":  # a's low byte -> d's low half, its high byte -> the high half
            a = np.asarray(val(args[1]), dtype=np.uint32)
            put(args[0], _pack(_e4m3(a & 0xFF), _e4m3((a >> 8) & 0xFF)))
        elif op == "cvt.rn.f16x2.f32":  # d = {a in the high half, b in the low}
            put(args[0], _pack(np.asarray(val(args[2]), dtype=np.float64), np.asarray(val(args[1]), dtype=np.float64)))
        else:
            raise NotImplementedError(f"the PTX model has no {op!r}")
    return written
