"""FP8 codes stored as uint8, encoded and decoded with integer arithmetic.

Why not Triton's fp8 types: RTX 3090 (sm_86) has no ``fp8e4nv`` in Triton, and the
interpreter's fp32->fp8 cast mis-rounds and does not saturate (DESIGN section 6). So a
cache or weight holds raw bytes, and kernels decode them with the two helpers below; the
results equal torch's ``float8_e4m3fn`` / ``float8_e5m2`` conversions bit for bit.

Formats (sign, exponent, mantissa bits; bias; largest finite):
- ``e4m3`` (``float8_e4m3fn``): 1-4-3, bias 7, 448; no infinities.
- ``e5m2`` (``float8_e5m2``): 1-5-2, bias 15, 57344.

Decode trick: both formats' exponent and mantissa fit an fp16 bit pattern. e5m2 *is* the
top byte of an fp16. For e4m3, ``(code & 0x7f) << 7`` is an fp16 with the same exponent
field under bias 15 instead of 7, so multiplying by 2**8 gives the value; this also holds
for subnormals, which map onto fp16 subnormals exactly (no fp32 flush-to-zero involved).

Three ways a kernel decodes (``fp8_decoder`` picks one per device and format):
- ``CVT_BITS``: the trick in Triton integer arithmetic, element by element (the interpreter);
- ``CVT_PTX``: the same trick on four codes at once in inline PTX (``E4M3_PTX``, ``E5M2_PTX``):
  two ``prmt`` move the bytes into the high bytes of two fp16 pairs, then an AND, a shift and a
  LOP3 per pair. Triton's element-wise code spends several 16-bit-emulating instructions
  per code, and decoding runs where ``tl.dot`` wants its operand, byte by byte: on sm_86 the
  paged decode loop counted 1337 instructions per 64-token tile with it and 1076 with the PTX
  (benchmarks/NOTES-kernels.md). GPUs only: the interpreter cannot run assembly; each GPU
  checks it once against torch before using it (``ptx_decoder_ok``).
- ``CVT_HW``: e4m3 by the hardware's ``cvt`` (sm_89+), two codes per instruction.
"""

import functools
import logging
import os

import torch

from qpage.kernels.triton_utils import INTERPRET, tl, triton

logger = logging.getLogger("qpage")

FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}


def fp8_max(fmt: str) -> float:
    return FP8_FORMATS[fmt][1]


def encode_fp8_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values -> uint8 codes, saturating at the format's largest finite value."""
    dtype, fmax = FP8_FORMATS[fmt]
    return x.float().clamp(-fmax, fmax).to(dtype).view(torch.uint8)


def decode_fp8_ref(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes -> fp32 values."""
    return codes.view(FP8_FORMATS[fmt][0]).float()


@triton.jit
def fp8_to_f32(code, IS_E5M2: tl.constexpr):
    """uint8 codes -> fp32 (see the module docstring for the bit trick)."""
    c = code.to(tl.int32)
    if IS_E5M2:
        h = (c << 8).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32)
    else:
        h = (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32) * 256.0


CVT_BITS = 0
CVT_PTX = 1
CVT_HW = 2

E4M3_PTX = tl.constexpr(
    "{ .reg .b32 t0, t1, m0, m1; "
    "prmt.b32 t0, $2, 0, 0x1404; "  # [0, c0, 0, c1]: codes 0 and 1 in the high bytes of two halves
    "prmt.b32 t1, $2, 0, 0x3424; "  # [0, c2, 0, c3]
    "and.b32 m0, t0, 0x7F007F00; "
    "and.b32 m1, t1, 0x7F007F00; "
    "shr.u32 m0, m0, 1; "  # (code & 0x7f) << 7 in each half
    "shr.u32 m1, m1, 1; "
    "lop3.b32 $0, t0, 0x80008000, m0, 0xEA; "  # | sign << 15: (a & b) | c
    "lop3.b32 $1, t1, 0x80008000, m1, 0xEA; }"
)
"""Four e4m3 codes (one 32-bit register, code i in byte i) -> four fp16 equal to value / 2**8
(``$0`` = codes 0 and 1, ``$1`` = codes 2 and 3, the lower index in the low half)."""

E5M2_PTX = tl.constexpr("{ prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424; }")
"""Four e5m2 codes -> four fp16 (each code is the high byte of its fp16)."""


DECODERS = {"bits": CVT_BITS, "ptx": CVT_PTX, "hw": CVT_HW}


def fp8_decoder(device: torch.device, fmt: str = "e4m3") -> int:
    """How kernels on ``device`` decode ``fmt`` codes: ``CVT_HW`` for e4m3 on sm_89+,
    ``CVT_PTX`` on other CUDA GPUs (and for e5m2) once it has passed ``ptx_decoder_ok``,
    ``CVT_BITS`` under the interpreter. ``QPAGE_FP8_DECODER=bits|ptx|hw`` forces one (to
    compare them on one GPU); a choice the device cannot run raises."""
    best = _best_decoder(device, fmt)
    forced = os.environ.get("QPAGE_FP8_DECODER", "")
    if not forced:
        return best
    if forced not in DECODERS:
        raise ValueError(f"QPAGE_FP8_DECODER={forced!r}: expected one of {sorted(DECODERS)}")
    cvt = DECODERS[forced]
    if cvt > best:
        if best == CVT_BITS and device.type == "cuda" and not INTERPRET:
            why = "the PTX decoder failed its check on this GPU (see the warning logged)"
        elif best == CVT_BITS:
            why = "the interpreter and CPUs run no PTX"
        else:
            why = "it needs e4m3 codes on sm_89 or later"
        raise ValueError(f"QPAGE_FP8_DECODER={forced} is not available for {fmt} here ({why}); unset it or choose "
                         f"{'bits' if best == CVT_BITS else 'bits or ptx'}")
    return cvt


def _best_decoder(device: torch.device, fmt: str) -> int:
    if INTERPRET or device.type != "cuda":
        return CVT_BITS
    if fmt == "e4m3" and _capability(device) >= (8, 9):
        return CVT_HW
    return CVT_PTX if ptx_decoder_ok(device, fmt) else CVT_BITS


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_PTX_CHECKED: dict[tuple[str, str], bool] = {}


def ptx_decoder_ok(device: torch.device, fmt: str) -> bool:
    """Whether ``CVT_PTX`` decodes every finite code on ``device`` exactly as torch does, checked
    once per process, device and format, at the first use outside a CUDA graph capture. On
    CPU the PTX is checked only by a model of its instructions (tests); if this GPU, driver
    or Triton disagree, kernels fall back to the element-wise bit trick with a warning
    instead of attending to wrong values."""
    key = (str(device), fmt)
    if key not in _PTX_CHECKED:
        if torch.cuda.is_current_stream_capturing():
            return True  # no launch or sync inside a capture; the check runs at the next use
        codes = torch.arange(1024, dtype=torch.int32).remainder(256).to(torch.uint8)
        got = _decode_all(codes, device, fmt, CVT_PTX).float()
        want = decode_fp8_ref(codes, fmt) / fp8_unit(fmt, CVT_PTX)
        finite = torch.isfinite(want)
        bad = int((got[finite] != want[finite]).sum())
        if bad:
            logger.warning("FP8 %s codes: the packed PTX decoder disagreed with torch on %d of %d codes on %s; "
                           "using the element-wise decoder (slower). Please report this with the GPU, driver and "
                           "Triton versions.", fmt, bad, int(finite.sum()), device)
        _PTX_CHECKED[key] = bad == 0
    return _PTX_CHECKED[key]


def _decode_all(codes: torch.Tensor, device: torch.device, fmt: str, cvt: int) -> torch.Tensor:
    """``codes`` (uint8 on CPU, a multiple of 1024 of them) decoded on ``device`` by
    ``fp8_to_f16`` with decoder ``cvt``; fp16 on CPU."""
    c = codes.reshape(-1).to(device)
    if c.numel() % 1024:
        raise ValueError(f"{c.numel()} codes: a multiple of 1024 expected")
    out = torch.empty(c.shape, dtype=torch.float16, device=device)
    _decode_kernel[(c.numel() // 1024,)](c, out, IS_E5M2=fmt == "e5m2", CVT=cvt, BLOCK=1024, num_warps=4)
    return out.cpu().reshape(codes.shape)


@functools.lru_cache(maxsize=16)
def sm90_plus(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0 or later (and not the interpreter)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_unit(fmt: str, cvt: int) -> float:
    """What ``fp8_to_f16`` leaves out under decoder ``cvt``: its result times this is the value."""
    return 256.0 if fmt == "e4m3" and cvt != CVT_HW else 1.0


@triton.jit
def fp8_to_f16(code, IS_E5M2: tl.constexpr, CVT: tl.constexpr):
    """uint8 codes -> fp16 equal to value / unit (``fp8_unit``): the bit trick for e4m3
    (value * 2**-8, exact) and e5m2, in Triton or in PTX (``CVT``), or the hardware
    conversion of e4m3 (``CVT_HW``, sm_89+)."""
    if CVT == 1 and IS_E5M2:  # CVT_PTX
        return tl.inline_asm_elementwise(E5M2_PTX, "=r,=r,r", [code], dtype=tl.float16, is_pure=True, pack=4)
    elif CVT == 1:
        return tl.inline_asm_elementwise(E4M3_PTX, "=r,=r,r", [code], dtype=tl.float16, is_pure=True, pack=4)
    elif IS_E5M2:
        return (code.to(tl.int16) << 8).to(tl.float16, bitcast=True)
    elif CVT == 2:  # CVT_HW
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        c = code.to(tl.int16)
        return (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def _decode_kernel(c_ptr, out_ptr, IS_E5M2: tl.constexpr, CVT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, fp8_to_f16(tl.load(c_ptr + offs), IS_E5M2, CVT))


@triton.jit
def f32_to_fp8(x, IS_E5M2: tl.constexpr):
    """fp32 -> uint8 codes, round to nearest even, saturating; integer arithmetic only."""
    if IS_E5M2:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        FMAX: tl.constexpr = 57344.0
    else:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        FMAX: tl.constexpr = 448.0
    DROP: tl.constexpr = 23 - MB
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: round the fp32 mantissa to MB bits (a carry moves into the exponent).
    r = a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)
    normal = ((((r >> 23) - 127 + BIAS) << MB) | ((r >> DROP) & ((1 << MB) - 1)))
    # Subnormal range: |x| / 2**(1 - BIAS - MB) rounded to an integer, from the mantissa.
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.maximum(tl.minimum((151 - BIAS - MB) - (a >> 23), 31), 1)  # only subnormal lanes use it
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a < ((128 - BIAS) << 23), q, normal)
    return (code | sign).to(tl.uint8)
