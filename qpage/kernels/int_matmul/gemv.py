"""INT4/INT8 GEMV (one activation row) for the GPTQ and AWQ layouts, without tensor cores.

Decode at batch 1: the whole cost is streaming the weight once. ``tl.dot`` would need the
unpacked tile in an MMA operand layout, and forming it (unpack, reshape, convert layout
through shared memory) costs more than the arithmetic at M = 1. Instead the words are
unpacked by shifts into a 3-D tile [words, values per word, columns] (GPTQ) or [rows, words,
values per word] (AWQ), the activations loaded in the matching shape, and the products summed
per tile: no reshape, no shared memory. ``q - z`` is formed without an int->float conversion:
OR q into the mantissa of 2**23 and subtract 2**23 + z. The group scale multiplies the tile's
partial sums, so a K tile must lie inside one quantization group (and there is no ``g_idx``).

The K loop is pipelined with ``tl.range(..., num_stages=config.num_stages)``: the launch's
``num_stages`` pipelines only loads that feed ``tl.dot``, so without it each program would
wait for every tile's words in turn. Layouts: ``common``.
"""

import torch

from qpage.kernels.configs import MatmulConfig
from qpage.kernels.int_matmul.common import col_shift, col_zero_scale
from qpage.kernels.split_k import finish_split_k, split_k_output, split_k_range
from qpage.kernels.triton_utils import tl, triton


def can_implement(cfg: MatmulConfig, m: int, group_size: int, act_order: bool) -> str | None:
    """Why the GEMV cannot run ``cfg`` on such a problem, or None."""
    if m != 1:
        return f"serves one activation row, not {m}"
    if act_order:
        return "act-order weights (g_idx) change group within a K tile"
    if group_size % cfg.block_k:
        return f"block_k {cfg.block_k} does not divide the group size {group_size}"
    return None


@triton.jit
def _int_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # bits of 2.0**23: OR-ed over q < 2**23, the float 2**23 + q
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
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
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
            z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                                  False, BITS, HAS_ZEROS)
            w = (vals | MAGIC).to(tl.float32, bitcast=True) - (z + 0x800000).to(tl.float32)[None, None, :]
            ks = offs_kp[:, None] * PACK + j[None, :]
            x = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [words, PACK]
            part = tl.sum(tl.sum(x[:, :, None] * w, axis=1), axis=0)
            acc += part * s
    if AWQ:
        ptrs = y_ptr + cols
        mask = n2_mask
        local = tl.arange(0, BLOCK_N // PACK)[:, None] * PACK + j[None, :]
    else:
        ptrs = y_ptr + offs_n
        mask = n_mask
        local = tl.arange(0, BLOCK_N)
    finish_split_k(acc, ptrs, mask, local, ws_ptr, lock_ptr, pid_n, tl.num_programs(0), pid_k,
                   BLOCK_N, SPLIT_K)


def gemv(
    x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *,
    bits: int, group_size: int, awq: bool, cfg: MatmulConfig,
) -> torch.Tensor:
    """``x2 [1, K] @ W [K, N]``; ``cfg`` passed ``can_implement``."""
    k = x2.shape[1]
    n = scales.shape[1]
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    y, ws, locks = split_k_output(1, n, x2.dtype, x2.device, cfg.split_k, grid[0], cfg.block_n)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    _int_gemv_kernel[grid](
        x2, qweight, scales, zeros, y, ws, locks, n, k, group_size,
        x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, SPLIT_K=cfg.split_k, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, LOOP_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
