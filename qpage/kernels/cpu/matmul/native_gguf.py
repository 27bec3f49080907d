"""Matmuls on weights in llama.cpp's block formats (``csrc/cpu_gguf.c``): the weight keeps
its file's bytes, regrouped once at load into the kernels' 16-row layout (``repack``);
activations are quantized to int8 blocks once per call and each block's dot product is an
integer one (layout and math in the C file).

Formats the kernels run, by ggml type id: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (``cpu_gguf.c``), Q4_K,
Q5_K (``cpu_gguf_q4k.c``), Q6_K (``cpu_gguf_q6k.c``), IQ4_NL, IQ4_XS and MXFP4 (``cpu_gguf_iq4.c``),
bitsandbytes' NF4 and FP4 written at load as IQ4_NL-style blocks (``formats.bnb``), and Q8_M
(qpage's 8-bit integer weights with a zero point, ``int_blocks``), whose activations carry a
second, residual int8 level (``needs_residual``).
``isa`` picks the instruction path ("vnni", "avx2", "scalar"; "auto" is the best this CPU
has); the paths agree up to the order of float additions. The reference is
``gguf.quants.dequantize`` and an fp32 matmul on the same int8-quantized activations
(tests/kernels/test_cpu_gguf.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from qpage.kernels.cpu.matmul import block_rewrite
from qpage.kernels.cpu.matmul.dense import DensePanels
from qpage.kernels.cpu.native import as_i64, load, num_threads

BLOCK = 32
ROWS = 16
"""Rows per group of the kernels' layout; a weight's rows are padded to a multiple."""
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
"""The ggml type ids of the formats the kernels run."""
NF4, FP4 = 200, 201
"""qpage's ids (past ggml's) for bitsandbytes' 4-bit codebooks, on IQ4_NL's 32-weight block:
an fp16 d = absmax / c, then the codes of weights j and j + 16 in byte j's low and high
nibble; a weight is d times its codebook value times c, rounded (c in ``formats.bnb``)."""
Q8_M = 202
"""qpage's id for Q8_0's block with an fp16 m after d (36 bytes: d, m, 32 int8 codes c;
w = d c + m): integer weights with a zero point at 8 bits, as Q4_1 is at 4."""
MXFP4, MXFP4_NL = 39, 203
"""ggml's MXFP4 (17 bytes per 32 weights: an E8M0 exponent, then E2M1 codes as IQ4_NL's
nibbles), and qpage's id for the same weights on IQ4_NL's block: fp16 d = 2^(e-128) and E2M1
values times 2 as the codebook (``block_rewrite.mxfp4_as_nl``, exact)."""
NAMES = {NF4: "NF4", FP4: "FP4", Q8_M: "Q8_M", MXFP4_NL: "MXFP4_NL"}
REWRITTEN = {Q2_K: Q8_0, Q3_K: Q6_K, MXFP4: MXFP4_NL}
"""Formats the kernels run as another one, rewritten at load (``block_rewrite``)."""
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "vnni": 3}
ISA_NAMES = {v: k for k, v in ISAS.items()}


@dataclass(frozen=True)
class BlockType:
    """One format as the kernels hold it: weights per block, bytes of a block in the file and
    in the kernels' layout (K-quants' 6-bit scales unpacked to a byte each)."""

    weights: int
    file_bytes: int
    packed_bytes: int


@functools.cache
def block_types() -> dict[int, BlockType]:
    """The formats the kernels run, read from the C table (``qp_gguf_block_type``), plus those
    rewritten at load into one of them (their file blocks as gguf states them); empty without
    the native kernels."""
    lib = load()
    if lib is None:
        return {}
    out, info, i = {}, (ctypes.c_int32 * 4)(), 0
    while lib.qp_gguf_block_type(i, ctypes.addressof(info)) == 0:
        out[info[0]] = BlockType(info[1], info[2], info[3])
        i += 1
    for t, runs_as in REWRITTEN.items():
        if t not in {int(q) for q in GGMLQuantizationType}:
            continue  # a format the installed gguf package predates (MXFP4): no file holds it then
        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        target = out[runs_as]
        out[t] = BlockType(weights, nbytes, target.packed_bytes * weights // target.weights)
    return out


def isa_supported(isa: str) -> bool:
    """Whether this CPU (and build) can run the instruction path ``isa``."""
    lib = load()
    return lib is not None and bool(lib.qp_gguf_isa_supported(ISAS[isa]))


def best_isa() -> str:
    """The path ``auto`` runs here."""
    lib = load()
    assert lib is not None, "best_isa needs the native kernels; check load() first"
    return ISA_NAMES[lib.qp_gguf_best_isa()]


def unsupported_reason(ggml_type: int, k: int) -> str | None:
    """Why the kernels cannot run a weight of this format and row length (None: they can)."""
    types = block_types()
    if not types:
        return "the native CPU kernels are not loaded"
    if ggml_type not in types:
        return (f"ggml type {ggml_type} has no native kernel (those run: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, "
                "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, bitsandbytes NF4/FP4, and qpage's Q8_M)")
    size = types[ggml_type].weights
    if k % size:
        return f"rows of {k} weights are not whole {size}-weight blocks"
    return None


def row_bytes(ggml_type: int, k: int, packed: bool = False) -> int:
    """Bytes of one row of k weights in a format the kernels run: in the file, or ``packed``
    in the kernels' layout."""
    t = block_types()[ggml_type]
    return k // t.weights * (t.packed_bytes if packed else t.file_bytes)


@dataclass
class PackedWeight:
    """A weight [n, k] in the kernels' 16-row layout: ``data`` uint8, the file's bytes for n
    rows plus zero rows up to a multiple of 16."""

    data: torch.Tensor
    ggml_type: int
    n: int
    k: int


def repack(rows: torch.Tensor | np.ndarray | list[np.ndarray], ggml_type: int, k: int) -> PackedWeight:
    """File rows uint8 [n, k / 32 * block bytes] -> the kernels' layout (a new tensor). A list
    of row blocks (the parts of a fused projection) is packed as their concatenation; parts
    other than the last must have a multiple of 16 rows (else they are concatenated first)."""
    lib = load()
    assert lib is not None, "repack needs the native kernels; check load() first"
    parts = [r.numpy() if isinstance(r, torch.Tensor) else r for r in (rows if isinstance(rows, list) else [rows])]
    if any(p.shape[0] % ROWS for p in parts[:-1]):
        parts = [np.concatenate(parts)]
    why = unsupported_reason(ggml_type, k)
    want = row_bytes(ggml_type, k) if why is None else 0
    for p in parts:
        if why is None and (p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] != want):
            why = f"rows must be uint8 [n, {want}], got {p.dtype} {tuple(p.shape)}"
    if why is not None:
        raise ValueError(f"gguf repack: {why}")
    if ggml_type in REWRITTEN:
        rewrite = {Q3_K: block_rewrite.q3k_as_q6k, Q2_K: block_rewrite.q2k_as_q8_0,
                   MXFP4: block_rewrite.mxfp4_as_nl}[ggml_type]
        parts, ggml_type = [rewrite(p) for p in parts], REWRITTEN[ggml_type]
    n = sum(p.shape[0] for p in parts)
    out = torch.empty(-(-n // ROWS) * ROWS * row_bytes(ggml_type, k, packed=True), dtype=torch.uint8)
    first = 0
    for p in parts:
        src = np.ascontiguousarray(p)
        lib.qp_gguf_repack(ggml_type, src.ctypes.data, src.shape[0], k, out.data_ptr(), first, num_threads())
        first += src.shape[0]
    return PackedWeight(out, ggml_type, n, k)


def needs_residual(ggml_type: int) -> bool:
    """Whether the format's matmul takes the activations with a residual level (Q8_M: against
    8-bit weights one int8 level is the larger rounding of the two; ``act_residual`` in C
    decides)."""
    lib = load()
    return lib is not None and bool(lib.qp_gguf_act_residual(ggml_type))


@dataclass
class QuantizedActivations:
    """x [m, k] as int8 blocks: codes q [m, k], scales d [m, k / 32], d * sum(codes) s; with a
    residual level, x - d q as int8 blocks the same way (r, rd, rs), else None."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    r: torch.Tensor | None = None
    rd: torch.Tensor | None = None
    rs: torch.Tensor | None = None

    def seen(self) -> torch.Tensor:
        """The activations the kernels multiply, in fp64 [m, k]."""
        m, k = self.q.shape

        def level(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            return (q.double().view(m, k // BLOCK, BLOCK) * d.double()[..., None]).view(m, k)

        return level(self.q, self.d) + (0 if self.r is None or self.rd is None else level(self.r, self.rd))


def quantize_activations(x: torch.Tensor, threads: int | None = None, residual: bool = False
                         ) -> QuantizedActivations:
    """fp32 x [m, k] (rows contiguous, k % 32 == 0) -> int8 blocks, per block amax / 127;
    ``residual``: also the second level."""
    lib = load()
    assert lib is not None, "quantize_activations needs the native kernels; check load() first"
    m, k = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or k % BLOCK:
        raise ValueError(f"quantize_activations: needs fp32 rows of whole 32-blocks on cpu, got {tuple(x.shape)} "
                         f"{x.dtype} stride {x.stride()}")

    def level() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK))

    act = QuantizedActivations(*level(), *(level() if residual else (None, None, None)))
    lib.qp_quantize_act(x.data_ptr(), x.stride(0), m, k, act.q.data_ptr(), act.d.data_ptr(), act.s.data_ptr(),
                        *(_ptr_or_none(t) for t in (act.r, act.rd, act.rs)), threads or num_threads())
    return act


def _ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul_into(out: torch.Tensor, act: QuantizedActivations, w: PackedWeight, threads: int | None = None,
                isa: str = "auto") -> None:
    """out [m, n] (fp32, rows contiguous; may be a column slice of a wider output) = act . W^T."""
    lib = load()
    assert lib is not None, "matmul_into needs the native kernels; check load() first"
    m, k = act.q.shape
    if k != w.k or out.dtype != torch.float32 or tuple(out.shape) != (m, w.n) or out.stride(1) != 1:
        raise ValueError(f"gguf matmul: activations [{m}, {k}] and weight [{w.n}, {w.k}] need fp32 out [{m}, {w.n}] "
                         f"with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    rc = lib.qp_gguf_matmul(w.ggml_type, w.data.data_ptr(), w.n, k, act.q.data_ptr(), act.d.data_ptr(),
                            act.s.data_ptr(), *(_ptr_or_none(t) for t in (act.r, act.rd, act.rs)), m,
                            out.data_ptr(), out.stride(0), threads or num_threads(), ISAS[isa])
    if rc != 0:
        raise MemoryError("gguf matmul: no memory for its scratch") if rc == -2 else ValueError(
            f"gguf matmul: the {isa} path cannot run on this CPU")


def dequantize_rows(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [*ids.shape, k]: rows ``ids`` of W dequantized, as llama.cpp does (an embedding lookup)."""
    lib = load()
    assert lib is not None, "dequantize_rows needs the native kernels; check load() first"
    idx = as_i64(ids.reshape(-1))
    out = torch.empty(idx.numel(), w.k, dtype=torch.float32)
    rc = lib.qp_gguf_dequant_rows(w.ggml_type, w.data.data_ptr(), w.n, w.k, idx.data_ptr(), idx.numel(),
                                  out.data_ptr())
    if rc != 0:
        raise ValueError(f"gguf dequantize_rows: a row id outside [0, {w.n})")
    return out.reshape(*ids.shape, w.k)


_SCRATCH = threading.local()
"""Per thread: the quantized activations of the matmul running on it."""

Piece = tuple[int, int, "PackedWeight | DensePanels"]
"""Output columns [c0, c1) of a matmul and their weight: in a block format, or dense fp32."""


class PiecewiseMatmul:
    """x [m, k] -> [m, n] over weights stored in pieces of output columns (a fused projection
    whose parts have different formats): activations are quantized once for all packed
    pieces, and each piece writes its own columns of one output. The checks are made once
    here; a call is one C call per piece plus the quantization. With ``input_perm`` the
    weights hold their input rows in that order (act-order, ``int_blocks``), and the
    activations' columns are gathered the same way first."""

    def __init__(self, pieces: list[Piece], k: int, n: int, threads: int | None = None,
                 input_perm: torch.Tensor | None = None) -> None:
        edges = sorted((c0, c1) for c0, c1, _ in pieces)
        if not edges or edges[0][0] != 0 or edges[-1][1] != n or any(a[1] != b[0] for a, b in pairwise(edges)):
            raise ValueError(f"pieces {edges} do not tile the output columns [0, {n})")
        for c0, c1, w in pieces:
            if w.k != k or w.n != c1 - c0:
                raise ValueError(f"piece [{c0}, {c1}) holds a [{w.n}, {w.k}] weight, expected [{c1 - c0}, {k}]")
        lib = load()
        assert lib is not None, "PiecewiseMatmul needs the native kernels; check load() first"
        if input_perm is not None and tuple(input_perm.shape) != (k,):
            raise ValueError(f"input_perm has shape {tuple(input_perm.shape)}, expected ({k},)")
        self._lib, self.pieces, self.k, self.n = lib, pieces, k, n
        self.input_perm = None if input_perm is None else input_perm.long().cpu()
        self.threads = threads or num_threads()
        self._packed = [(c0, w.ggml_type, w.data.data_ptr(), w.n) for c0, _, w in pieces if isinstance(w, PackedWeight)]
        self._dense = [(c0, c1, w) for c0, c1, w in pieces if not isinstance(w, PackedWeight)]
        self.residual = any(needs_residual(t) for _, t, _, _ in self._packed)
        """Whether the activations are quantized with their residual level (an 8-bit piece)."""

    def weight_bytes(self) -> int:
        return sum(w.data.numel() if isinstance(w, PackedWeight) else w.nbytes for _, _, w in self.pieces)

    def packed_pieces(self) -> list[tuple[int, int, int, int]]:
        """(first column, ggml type, weight address, rows) of each packed piece."""
        return list(self._packed)

    def dense_pieces(self) -> list[tuple[int, int, DensePanels]]:
        """(first column, end column, weight) of each dense fp32 piece."""
        return list(self._dense)

    def _activation_buffers(self, m: int) -> tuple[int, ...]:
        """Addresses of m rows of quantized activations (q, d, s, then the residual's r, rd,
        rs or None) in this thread's scratch, which every matmul shares (each call quantizes
        its input and consumes it before returning)."""
        levels = 2 if self.residual else 1
        codes, scales = m * self.k, 4 * m * (self.k // BLOCK)
        buf = getattr(_SCRATCH, "buf", None)
        need = levels * (codes + 2 * scales)
        if buf is None or buf.numel() < need:
            buf = _SCRATCH.buf = torch.empty(need, dtype=torch.uint8)
        at = [buf.data_ptr() + i * (codes + 2 * scales) for i in range(levels)]
        level = [(a, a + codes, a + codes + scales) for a in at]
        return (*level[0], *(level[1] if self.residual else (None, None, None)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.k)
        if dtype != torch.float32 or x2.stride(1) != 1 or x2.device.type != "cpu":
            x2 = x2.to("cpu", torch.float32).contiguous()
        if self.input_perm is not None:
            x2 = x2.index_select(1, self.input_perm)
        m = x2.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        if self._packed:
            act = self._activation_buffers(m)
            lib = self._lib
            lib.qp_quantize_act(x2.data_ptr(), x2.stride(0), m, self.k, *act, self.threads)
            optr = out.data_ptr()
            for c0, t, w, n in self._packed:
                rc = lib.qp_gguf_matmul(t, w, n, self.k, *act, m, optr + 4 * c0, self.n, self.threads, 0)
                if rc != 0:
                    raise MemoryError("gguf matmul: no memory for its scratch") if rc == -2 else ValueError(
                        f"gguf matmul: ggml type {t} cannot run on this CPU")
        for c0, c1, w in self._dense:
            w.into(x2, out[:, c0:c1])
        return out.reshape(*shape[:-1], self.n).to(dtype)
