"""INT4/INT8 (GPTQ, AWQ layouts) dequantized to a dense weight, and the large-M matmul on it.

For prefill-sized M the matmul is compute-bound: the fused kernel's in-register dequant
then competes with the tensor cores for issue slots, and each weight tile is dequantized
once per row tile of x. Dequantizing once into a dense [K, N] buffer and calling cuBLAS
costs a read of the packed weight plus a write and a read of the dense one, which for
M >= ``configs.DEQUANT_MIN_M`` is less than the fused kernel loses. The dense buffer
is built ``max_chunk_bytes`` of columns at a time, so an 8B model's 128256-column head
never needs its full 1 GB fp16 copy.
"""

import torch

from qpage.kernels.int_matmul.common import gather_q, group_zero_scale
from qpage.kernels.triton_utils import tl, triton


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr,
    N, K, group_size, n0,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wk, stride_wn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Columns [n0, N) of the weight into ``w`` [K, N - n0]."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    q = gather_q(qw_ptr, offs_k, offs_n, k_mask, n_mask, stride_qk, stride_qn, AWQ, BITS)
    z, s = group_zero_scale(s_ptr, z_ptr, g_ptr, offs_k, offs_n, k_mask, n_mask, group_size,
                            stride_sg, stride_sn, stride_zg, stride_zn, AWQ, BITS, HAS_ZEROS, HAS_GIDX)
    w = (q - z).to(tl.float32) * s
    tl.store(w_ptr + offs_k[:, None] * stride_wk + (offs_n - n0)[None, :] * stride_wn,
             w.to(w_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


def dequantize_int(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, g_idx: torch.Tensor | None, *,
    bits: int, group_size: int, in_features: int, awq: bool = False, dtype: torch.dtype = torch.float16,
    columns: tuple[int, int] | None = None, block_k: int = 64, block_n: int = 64,
) -> torch.Tensor:
    """The dense weight [K, n1 - n0] in ``dtype`` for ``columns`` (n0, n1) (all by default);
    n0 must be a multiple of 8 for the AWQ layout."""
    n = scales.shape[1]
    n0, n1 = columns or (0, n)
    if awq and n0 % 8:
        raise ValueError(f"AWQ columns must start at a multiple of 8, got {n0}")
    w = torch.empty((in_features, n1 - n0), dtype=dtype, device=qweight.device)
    zeros = qzeros if qzeros is not None else qweight
    gidx = g_idx if g_idx is not None else qweight
    grid = (triton.cdiv(in_features, block_k), triton.cdiv(n1 - n0, block_n))
    _dequant_kernel[grid](
        qweight, scales, zeros, gidx, w, n1, in_features, group_size, n0,
        qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
        w.stride(0), w.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, HAS_GIDX=g_idx is not None,
        BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return w


def dequant_matmul(
    x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, *, bits: int, group_size: int, awq: bool, max_chunk_bytes: int = 64 << 20,
) -> torch.Tensor:
    """``x2 [M, K] @ W`` through a dense copy of W, ``max_chunk_bytes`` of columns at a time."""
    k = x2.shape[1]
    n = scales.shape[1]
    cols = max(128, max_chunk_bytes // (k * x2.element_size()) // 128 * 128)
    outs = []
    for n0 in range(0, n, cols):
        w = dequantize_int(qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size, in_features=k,
                           awq=awq, dtype=x2.dtype, columns=(n0, min(n, n0 + cols)))
        outs.append(x2 @ w)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
