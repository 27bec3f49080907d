"""INT4/INT8 GEMV (one activation row) for the GPTQ and AWQ layouts, without tensor cores.

Same packed layouts as ``quant_matmul`` (see its docstring); this kernel serves M = 1 with
no ``g_idx`` and a K tile inside one quantization group, which is decode at batch 1, where
the whole cost is streaming the weight once.

Why a separate kernel: ``tl.dot`` needs the unpacked weight tile in an MMA operand layout,
and forming it (unpack, reshape, convert layout through shared memory) costs more than the
arithmetic at M = 1. Here the packed words stay in registers as a 3-D tile
[words, values per word, columns] (GPTQ) or [rows, words, values per word] (AWQ); the
activations are loaded in the matching shape, and the products are summed in place:
no reshape, no shared memory. ``q - z`` is formed without an int->float conversion: OR q
into the mantissa of 2**23 and subtract 2**23 + z. The group scale multiplies the tile's
partial sums, not each weight.
"""

import torch

from qpage.kernels.quant_matmul import MatmulConfig, col_shift
from qpage.kernels.split_k import finish_split_k, split_k_output, split_k_range
from qpage.kernels.triton_utils import tl, triton


@triton.jit
def _int_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # bits of 2.0**23
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    j = tl.arange(0, PACK)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    if AWQ:
        offs_c = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)  # word columns
        cols = offs_c[:, None] * PACK + j[None, :]  # [words, PACK] logical columns
        c_mask = offs_c < tl.cdiv(N, PACK)
        n2_mask = cols < N
        shifts = col_shift(j, True, BITS)
        acc = tl.zeros((BLOCK_N // PACK, PACK), dtype=tl.float32)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(t_start, t_end):
        grp = (t * BLOCK_K) // group_size
        if AWQ:
            offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            packed = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_c[None, :] * stride_qn,
                             mask=k_mask[:, None] & c_mask[None, :], other=0)
            vals = (packed[:, :, None] >> shifts[None, None, :]) & QMASK  # [BLOCK_K, words, PACK]
            if HAS_ZEROS:
                zp = tl.load(z_ptr + grp * stride_zg + offs_c * stride_zn, mask=c_mask, other=0)
                z = (zp[:, None] >> shifts[None, :]) & QMASK
            else:
                z = tl.full((BLOCK_N // PACK, PACK), 1 << (BITS - 1), dtype=tl.int32)
            w = (vals | MAGIC).to(tl.float32, bitcast=True) - (z + 0x800000).to(tl.float32)[None, :, :]
            x = tl.load(x_ptr + offs_k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(x[:, None, None] * w, axis=0)
            s = tl.load(s_ptr + grp * stride_sg + cols * stride_sn, mask=n2_mask, other=0.0)
            acc += part * s.to(tl.float32)
        else:
            offs_kp = t * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)  # word rows
            kp_mask = offs_kp < tl.cdiv(K, PACK)
            packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                             mask=kp_mask[:, None] & n_mask[None, :], other=0)
            vals = (packed[:, None, :] >> (j * BITS)[None, :, None]) & QMASK  # [words, PACK, BLOCK_N]
            if HAS_ZEROS:
                zp = tl.load(z_ptr + grp * stride_zg + (offs_n // PACK) * stride_zn, mask=n_mask, other=0)
                z = (zp >> col_shift(offs_n, False, BITS)) & QMASK
            else:
                z = tl.full((BLOCK_N,), 1 << (BITS - 1), dtype=tl.int32)
            w = (vals | MAGIC).to(tl.float32, bitcast=True) - (z + 0x800000).to(tl.float32)[None, None, :]
            ks = offs_kp[:, None] * PACK + j[None, :]
            x = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [words, PACK]
            part = tl.sum(tl.sum(x[:, :, None] * w, axis=1), axis=0)
            s = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            acc += part * s.to(tl.float32)
    if AWQ:
        ptrs = y_ptr + cols
        mask = n2_mask
        local = tl.arange(0, BLOCK_N // PACK)[:, None] * PACK + j[None, :]
    else:
        ptrs = y_ptr + offs_n
        mask = n_mask
        local = tl.arange(0, BLOCK_N)
    finish_split_k(acc, ptrs, mask, local, ws_ptr, lock_ptr, pid_n, tl.num_programs(0), pid_k,
                   BLOCK_N, SPLIT_K, SERIAL)


def int_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *,
    bits: int, group_size: int, awq: bool, config: MatmulConfig,
) -> torch.Tensor:
    """``x [1, K] @ W [K, N]``; the caller (``int_matmul``) checked that this kernel applies."""
    k = x.shape[1]
    n = scales.shape[1]
    split = config.split_k
    grid = (triton.cdiv(n, config.block_n), split)
    y, ws, locks, serial = split_k_output(1, n, x.dtype, x.device, split, config.serial, grid[0], config.block_n)
    zeros = qzeros if qzeros is not None else qweight
    _int_gemv_kernel[grid](
        x, qweight, scales, zeros, y, ws, locks, n, k, group_size,
        x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, SPLIT_K=split, SERIAL=serial,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y.to(x.dtype)
