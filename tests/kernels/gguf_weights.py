"""Block-format weights for the kernel tests: quantized by the ``gguf`` package (llama.cpp's
reference quantizers), or, for the formats it cannot write, random blocks (any byte pattern is
a valid block, with d in [0.001, 0.011)), with the fp32 weights the kernels hold. qpage's own
Q8_M, which ``gguf`` cannot read, is decoded by ``q8m_dequantize`` from its definition."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from qpage.formats import bnb
from qpage.kernels.cpu.matmul import block_rewrite
from qpage.kernels.cpu.matmul import native_gguf as ng

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "NF4": ng.NF4, "FP4": ng.FP4, "Q8_M": ng.Q8_M, "MXFP4": ng.MXFP4,
         "MXFP4_NL": ng.MXFP4_NL}
RANDOM = {"Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)),
          "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)), "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,))}
"""Formats ``gguf`` cannot quantize, made as random blocks: weights and bytes per block, and
where the block's fp16 scales sit (d, then dmin)."""
DMIN = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}
"""dmin / d that centres a K-quant's random weights on 0 (the mean code), as real blocks are."""


def quantized_weight(name: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(file rows uint8 [n, row bytes], their fp32 dequantization [n, k])."""
    rng = np.random.default_rng(seed)
    if name in ("NF4", "FP4"):
        return bnb_weight(name.lower(), n, k, rng)
    if name == "Q8_M":
        return q8m_weight(n, k, rng)
    if name == "MXFP4_NL":  # MXFP4 blocks as the kernels hold them (block_rewrite.mxfp4_as_nl), the same weights
        rows, w = quantized_weight("MXFP4", n, k, seed)
        return block_rewrite.mxfp4_as_nl(rows), w
    qt = GGMLQuantizationType[name]
    if name in RANDOM:
        size, nbytes, scales = RANDOM[name]
        raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
        d = rng.random((n, k // size)) * 0.01 + 0.001
        for i, at in enumerate(scales):
            raw[..., at : at + 2] = (d * (1, DMIN.get(name, 0))[i]).astype(np.float16).view(np.uint8).reshape(
                n, k // size, 2)
        rows = raw.reshape(n, -1)
    else:
        rows = quantize(rng.standard_normal((n, k)).astype(np.float32), qt)
    if name == "Q2_K":  # the kernels hold it rewritten as Q8_0 (test_rewritten_formats bounds the change)
        return rows, torch.from_numpy(dequantize(block_rewrite.q2k_as_q8_0(rows), GGMLQuantizationType.Q8_0))
    return rows, torch.from_numpy(dequantize(rows, qt).astype(np.float32))


def bnb_weight(quant_type: str, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """Random bitsandbytes codes and absmax per 64 weights as the loader writes them, and the
    weight the kernels hold: d = fp16(absmax / c) times round(codebook * c)."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    absmax = (rng.random((n, k // 64)) * 1.2 + 0.14).astype(np.float32)
    c = bnb.KERNEL_SCALE[quant_type]
    rows = bnb.block_rows(codes, absmax / np.float32(c), 64)
    assert rows is not None
    d = np.repeat((absmax / np.float32(c)).astype(np.float16).astype(np.float64), 64, axis=1)
    return rows, torch.from_numpy(d * np.round(bnb.CODEBOOKS[quant_type].astype(np.float64) * c)[codes]).float()


def q8m_dequantize(rows: np.ndarray) -> np.ndarray:
    """Q8_M rows [n, k / 32 * 36] -> fp32 [n, k]: per block fp16 d, fp16 m, 32 int8 c; w = d c + m."""
    b = rows.reshape(rows.shape[0], -1, 36)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    c = b[..., 4:].view(np.int8).astype(np.float32)
    return (d * c + m).reshape(rows.shape[0], -1)


def q8m_weight(n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q8_M blocks: codes anywhere in int8, d in [0.001, 0.011), m within +-64 d (a zero
    point off centre, as asymmetric 8-bit weights have)."""
    nb = k // 32
    d = (rng.random((n, nb)) * 0.01 + 0.001).astype(np.float16)
    m = (d.astype(np.float32) * rng.uniform(-64, 64, (n, nb))).astype(np.float16)
    c = rng.integers(-128, 128, (n, nb, 32)).astype(np.int8)
    rows = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), m.view(np.uint8).reshape(n, nb, 2),
                           c.view(np.uint8)], axis=2).reshape(n, -1)
    return rows, torch.from_numpy(q8m_dequantize(rows))
