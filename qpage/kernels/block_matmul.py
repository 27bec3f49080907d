"""llama.cpp block formats on CUDA (Triton): the CUDA side of ``kernels.cpu.matmul.native_gguf``.

Q4_0 and Q8_0 are symmetric integers in groups of 32, so they are written once as the GPTQ
layout (``to_gptq``: exact) and run on the INT4/INT8 kernels (``int_matmul``). Q4_1, Q4_K and
Q6_K keep the file's bytes on the device; ``dequant_matmul`` decodes them into a dense weight
some columns at a time and multiplies with cuBLAS (the file's layouts, read here, are in
``cpu_gguf*.c`` and llama.cpp's ggml-quants.c):
- Q4_1, per 32 weights (20 B): fp16 d, fp16 m, 16 B of nibbles (byte j: weight j low,
  j + 16 high); w = d q + m.
- Q4_K, per 256 (144 B): fp16 d, fp16 dmin, 12 B of 6-bit scales and mins for eight
  32-weight sub-blocks, 128 B of nibbles (bytes 32c..32c+31: sub-block 2c low, 2c+1 high);
  w = d sc q - dmin mn.
- Q6_K, per 256 (210 B): 128 B of low nibbles, 64 B of high 2-bit pairs, 16 int8 scales (one
  per 16 weights), fp16 d; w = d sc (q - 32).
Tests run them under Triton's interpreter against the ``gguf`` package's dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qpage.kernels.int_matmul import int_matmul
from qpage.kernels.packing import pack_rows
from qpage.kernels.triton_utils import tl, triton

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
"""The ggml type ids run here."""
GPTQ_TYPES = {Q4_0: 4, Q8_0: 8}
"""Formats written as GPTQ integers: their bits."""
DEQUANT_TYPES = {Q4_1: (32, 20), Q4_K: (256, 144), Q6_K: (256, 210)}
"""Formats decoded from the file's bytes: (weights, bytes) per block."""


def unsupported_reason(ggml_type: int, k: int) -> str | None:
    """Why this module cannot run a weight of this format and row length (None: it can)."""
    if ggml_type in GPTQ_TYPES:
        return None if k % 32 == 0 else f"rows of {k} weights are not whole 32-weight blocks"
    if ggml_type not in DEQUANT_TYPES:
        return f"ggml type {ggml_type} has no CUDA kernel (Q4_0, Q4_1, Q8_0, Q4_K and Q6_K have)"
    size = DEQUANT_TYPES[ggml_type][0]
    return None if k % size == 0 else f"rows of {k} weights are not whole {size}-weight blocks"


@dataclass
class GptqWeight:
    """A Q4_0/Q8_0 weight [n, k] as GPTQ integers (symmetric: zero 2^(bits-1)), group 32."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int_matmul(x, self.qweight, self.scales, None, None, bits=self.bits, group_size=32)


def to_gptq(rows: np.ndarray, ggml_type: int, k: int, device: torch.device, step: int = 0) -> GptqWeight:
    """File rows uint8 [n, k / 32 * block bytes] of Q4_0 or Q8_0 -> the GPTQ layout (exact),
    ``step`` rows at a time (default: about 2^22 weights, so the packing's int64 temporaries
    stay small)."""
    n, bits = rows.shape[0], GPTQ_TYPES[ggml_type]
    step = step or max(1, (1 << 22) // k)
    qweight = torch.empty(k * bits // 32, n, dtype=torch.int32)
    scales = torch.empty(k // 32, n, dtype=torch.float16)
    for r0 in range(0, n, step):
        blocks = np.ascontiguousarray(rows[r0 : r0 + step]).reshape(-1, k // 32, rows.shape[1] // (k // 32))
        m = blocks.shape[0]
        scales[:, r0 : r0 + m] = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).reshape(m, k // 32)).t()
        if ggml_type == Q4_0:
            qs = blocks[:, :, 2:18]
            q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(m, k)  # already offset by 8
        else:
            q = (blocks[:, :, 2:34].copy().view(np.int8).astype(np.int16) + 128).reshape(m, k)
        qweight[:, r0 : r0 + m] = pack_rows(torch.from_numpy(q.astype(np.int32)).t(), bits)
    return GptqWeight(qweight.to(device), scales.to(device), bits)


@triton.jit
def _f16_at(ptr, off, mask):
    """The little-endian fp16 at byte ``off``, as fp32."""
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_kernel(rows_ptr, w_ptr, N, K, row_bytes, n0, stride_wk, stride_wn,
                    TYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [n0, N) of W^T into ``w`` [K, N - n0] (W's rows are the file's rows)."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    row = rows_ptr + offs_n.to(tl.int64)[None, :] * row_bytes
    k = offs_k[:, None]
    if TYPE == 3:  # Q4_1
        blk = (k // 32) * 20
        i = k % 32
        d = _f16_at(row, blk, mask)
        m = _f16_at(row, blk + 2, mask)
        byte = tl.load(row + blk + 4 + i % 16, mask=mask, other=0).to(tl.int32)
        q = (byte >> ((i // 16) * 4)) & 15
        w = d * q.to(tl.float32) + m
    elif TYPE == 12:  # Q4_K
        blk = (k // 256) * 144
        i = k % 256
        j = i // 32  # sub-block
        d = _f16_at(row, blk, mask)
        dmin = _f16_at(row, blk + 2, mask)
        lo = j % 4
        a = tl.load(row + blk + 4 + lo, mask=mask, other=0).to(tl.int32)  # scales[j % 4]
        b = tl.load(row + blk + 8 + lo, mask=mask, other=0).to(tl.int32)  # scales[4 + j % 4]
        c = tl.load(row + blk + 12 + lo, mask=mask, other=0).to(tl.int32)  # scales[8 + j % 4]
        sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4))
        mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
        byte = tl.load(row + blk + 16 + (i // 64) * 32 + i % 32, mask=mask, other=0).to(tl.int32)
        q = (byte >> (((i // 32) % 2) * 4)) & 15
        w = d * sc.to(tl.float32) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    else:  # Q6_K
        blk = (k // 256) * 210
        i = k % 256
        h = i // 128
        r = i % 128
        low = tl.load(row + blk + 64 * h + r % 64, mask=mask, other=0).to(tl.int32)
        high = tl.load(row + blk + 128 + 32 * h + r % 32, mask=mask, other=0).to(tl.int32)
        q = ((low >> ((r // 64) * 4)) & 15) | (((high >> ((r // 32) * 2)) & 3) << 4)
        sc = tl.load(row + blk + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16_at(row, blk + 208, mask)
        w = d * sc * (q - 32).to(tl.float32)
    tl.store(w_ptr + offs_k[:, None] * stride_wk + (offs_n - n0)[None, :] * stride_wn,
             w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize(rows: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype = torch.float16,
               columns: tuple[int, int] | None = None, block_k: int = 64, block_n: int = 32) -> torch.Tensor:
    """W^T [k, n1 - n0] in ``dtype`` from file rows uint8 [n, row bytes] (on the kernel's
    device) for ``columns`` (n0, n1) of W's rows (all by default)."""
    n = rows.shape[0]
    n0, n1 = columns or (0, n)
    w = torch.empty((k, n1 - n0), dtype=dtype, device=rows.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n1 - n0, block_n))
    _dequant_kernel[grid](rows, w, n1, k, rows.shape[1], n0, w.stride(0), w.stride(1),
                          TYPE=ggml_type, BLOCK_K=block_k, BLOCK_N=block_n)
    return w


@dataclass
class DequantWeight:
    """A Q4_1/Q4_K/Q6_K weight [n, k] as the file's rows on the device."""

    rows: torch.Tensor
    ggml_type: int
    k: int
    max_chunk_bytes: int = 64 << 20

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] @ W^T through a dense copy of W, ``max_chunk_bytes`` of it at a time."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        n = self.rows.shape[0]
        cols = max(128, self.max_chunk_bytes // (self.k * x2.element_size()) // 128 * 128)
        outs = [x2 @ dequantize(self.rows, self.ggml_type, self.k, x2.dtype, (n0, min(n, n0 + cols)))
                for n0 in range(0, n, cols)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.view(*lead, n)
