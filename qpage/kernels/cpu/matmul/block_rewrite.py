"""GGUF block formats the kernels run as another one, rewritten once at load: Q3_K as Q6_K
(exactly), Q2_K as Q8_0, and MXFP4 on IQ4_NL's block (exactly but for weights under 1e-6)
(``native_gguf.REWRITTEN``). The K-quant rewrites go a few thousand rows at a time, so their
temporaries (several bytes a weight) stay small; MXFP4's are a few bytes a block."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize


def q2k_as_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q2_K rows uint8 [n, k / 256 * 84] -> Q8_0 rows [n, k / 32 * 34] by llama.cpp's Q8_0
    quantizer (the ``gguf`` package's) on their exact dequantization. Q2_K's w = d sc q - dmin m
    per 16 weights has a per-16 offset no other kernel format holds; Q8_0 moves each weight by
    about 1/254 of its 32-block's largest magnitude at most (plus the fp16 rounding of the
    block's scale), a small part of a Q2_K step."""

    def one(chunk: np.ndarray) -> np.ndarray:
        w = dequantize(chunk, GGMLQuantizationType.Q2_K).astype(np.float32)
        return quantize(w, GGMLQuantizationType.Q8_0)

    return _by_chunks(rows, one, 84, 272)


def q3k_as_q6k(rows: np.ndarray) -> np.ndarray:
    """Q3_K rows uint8 [n, k / 256 * 110] -> the same weights as Q6_K rows [n, k / 256 * 210],
    exactly. Q3_K per 256 weights: 32 B of high bits, 64 B of 2-bit codes, 12 B of 6-bit
    scales (stored + 32), fp16 d; w = d (s - 32) (q2 - 4 (1 - h)) per 16 weights. That is
    Q6_K's w = d sc (q6 - 32) with sc = s - 32 and q6 = q2 + 4 h + 28, in 28..35."""
    i = np.arange(256)
    r = i % 128
    q_at, q_shift = 32 * (i // 128) + r % 32, (2 * (r // 32)).astype(np.uint8)
    h_shift = (i // 32).astype(np.uint8)
    j = np.arange(16)
    lo_shift, hi_shift = (4 * (j // 8)).astype(np.uint8), (2 * (j // 4)).astype(np.uint8)

    def one(chunk: np.ndarray) -> np.ndarray:
        b = chunk.reshape(-1, 110)
        hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
        q6 = ((qs[:, q_at] >> q_shift) & 3) + 4 * ((hmask[:, i % 32] >> h_shift) & 1) + np.uint8(28)
        s6 = ((sc[:, j % 8] >> lo_shift) & 15) | (((sc[:, 8 + j % 4] >> hi_shift) & 3) << 4)
        out = np.empty((b.shape[0], 210), dtype=np.uint8)
        for half in range(2):
            q = q6[:, 128 * half : 128 * half + 128]
            out[:, 64 * half : 64 * half + 64] = (q[:, :64] & 15) | ((q[:, 64:] & 15) << 4)
            hi = (q >> 4).reshape(-1, 4, 32)
            out[:, 128 + 32 * half : 160 + 32 * half] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
        out[:, 192:208] = (s6.astype(np.int16) - 32).astype(np.int8).view(np.uint8)
        out[:, 208:210] = b[:, 108:110]
        return out.reshape(chunk.shape[0], -1)

    return _by_chunks(rows, one, 110, 210)


MXFP4_MAX_EXPONENT = 143
"""The largest E8M0 exponent whose 2^(e-128) fp16 holds (2^15); from 104 up (2^-24, fp16's
smallest subnormal) it is exact, below that rounded (weights under 12 * 2^-24 move by at most
half of that: 4e-7)."""


def mxfp4_as_nl(rows: np.ndarray) -> np.ndarray:
    """MXFP4 rows uint8 [n, k / 32 * 17] (per block an E8M0 exponent e, then 16 bytes of E2M1
    codes, weight j in byte j's low nibble and j + 16 in its high one) -> the same weights as
    codebook blocks [n, k / 32 * 18]: fp16 d = 2^(e-128), then the same 16 bytes, each code
    standing for E2M1 times 2 (0, 1, 2, 3, 4, 6, 8, 12 and their negatives, ``cpu_gguf_iq4.c``).
    A block of zeros (ggml writes e = 0 for it) gets d = 0."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 17)
    e = b[..., 0].astype(np.int32)
    zero = ((b[..., 1:] & 0x77) == 0).all(-1)  # every code +-0
    e = np.where(zero, 128, e)
    if e.size and int(e.max()) > MXFP4_MAX_EXPONENT:
        raise ValueError(f"MXFP4 block scale 2^{int(e.max()) - 127} is beyond the kernels' fp16 scale "
                         f"(2^{MXFP4_MAX_EXPONENT - 127} at most)")
    d = np.where(zero, np.float32(0), np.ldexp(np.float32(1), e - 128)).astype(np.float16)
    out = np.empty((n, b.shape[1], 18), dtype=np.uint8)
    out[..., :2] = d[..., None].view(np.uint8)
    out[..., 2:] = b[..., 1:]
    return out.reshape(n, -1)


REWRITE_CHUNK = 1 << 22
"""Weights a rewrite handles at a time (its temporaries are several bytes a weight)."""


def _by_chunks(rows: np.ndarray, fn: Callable[[np.ndarray], np.ndarray], block_in: int, block_out: int) -> np.ndarray:
    """``fn`` over ``REWRITE_CHUNK`` weights of rows at a time, into one array of rows whose
    256-weight blocks are ``block_out`` bytes instead of ``block_in``."""
    n, nbytes = rows.shape
    out = np.empty((n, nbytes // block_in * block_out), dtype=np.uint8)
    step = max(1, REWRITE_CHUNK // (nbytes // block_in * 256))
    for r0 in range(0, n, step):
        out[r0 : r0 + step] = fn(np.ascontiguousarray(rows[r0 : r0 + step]))
    return out
