"""The general INT4/INT8 dequant-matmul (GPTQ and AWQ layouts): ``y = x @ W`` through ``tl.dot``.

A program computes a [BLOCK_M, BLOCK_N] tile of y; K is split over SPLIT_K programs when the
output tiles alone do not fill the GPU (``split_k``). Each weight tile is loaded once as
packed words, split into its P values and reshaped ([K / P, N] words -> [K, N] values for
GPTQ; [K, N / P] -> [K, N] for AWQ), dequantized in registers and fed to ``tl.dot`` in the
activation dtype (fp32 under the interpreter), accumulating in fp32. When the K tile lies in
one quantization group, the group's scale factors out of the tile: y += s * (x @ (q - z)).
Runs every case the layouts allow (act-order ``g_idx``, any group size, M >= 1), so it is
the fallback of the other kinds. Layouts: ``common``.
"""

import torch

from qpage.kernels.configs import MatmulConfig
from qpage.kernels.int_matmul.common import col_shift, col_zero_scale, group_zero_scale
from qpage.kernels.split_k import finish_tile, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton


def can_implement(cfg: MatmulConfig, bits: int, awq: bool) -> str | None:
    """Why this kernel cannot run ``cfg`` on such a weight, or None."""
    pack = 32 // bits
    if cfg.block_k % pack or cfg.block_n % pack:
        return f"block_k and block_n must be multiples of {pack} for {bits}-bit weights"
    if awq and cfg.block_n % 8:
        return "AWQ needs block_n to be a multiple of 8"
    return None


@triton.jit
def unpack_tile(packed, SHIFTS_ALONG_K: tl.constexpr, AWQ: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A packed int32 tile -> unsigned values [BLOCK_K, BLOCK_N] (each word loaded once)."""
    PACK: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    j = tl.arange(0, PACK)
    if SHIFTS_ALONG_K:  # GPTQ qweight [BLOCK_K / PACK, BLOCK_N]: word row r holds k = r * PACK + j
        vals = (packed[:, None, :] >> (j * BITS)[None, :, None]) & QMASK
        return tl.reshape(vals, (BLOCK_K, BLOCK_N))
    else:  # packed along N [rows, BLOCK_N / PACK]: word c holds n = c * PACK + j
        vals = (packed[:, :, None] >> col_shift(j, AWQ, BITS)[None, None, :]) & QMASK
        return tl.reshape(vals, (BLOCK_K, BLOCK_N))


@triton.jit
def _load_q_tile(qw_ptr, t, offs_k, offs_n, offs_np, k_mask, n_mask, np_mask, K, stride_qk, stride_qn,
                 BITS: tl.constexpr, AWQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight tile [BLOCK_K, BLOCK_N] as unsigned values, each packed word loaded once."""
    PACK: tl.constexpr = 32 // BITS
    if AWQ:
        packed = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_np[None, :] * stride_qn,
                         mask=k_mask[:, None] & np_mask[None, :], other=0)
        return unpack_tile(packed, False, True, BITS, BLOCK_K, BLOCK_N)
    else:
        offs_kp = t * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
        packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_kp < tl.cdiv(K, PACK))[:, None] & n_mask[None, :], other=0)
        return unpack_tile(packed, True, False, BITS, BLOCK_K, BLOCK_N)


@triton.jit
def _int_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr, MAGIC_F16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_np = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)  # packed columns
    m_mask = offs_m < M
    n_mask = offs_n < N
    np_mask = offs_np < tl.cdiv(N, PACK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = _load_q_tile(qw_ptr, t, offs_k, offs_n, offs_np, k_mask, n_mask, np_mask, K, stride_qk, stride_qn,
                         BITS, AWQ, BLOCK_K, BLOCK_N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if ONE_GROUP_PER_TILE:
            grp = (t * BLOCK_K) // group_size
            z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                                  AWQ, BITS, HAS_ZEROS)
            z = z[None, :]
            # The group's scale factors out of the tile: y += s * (x @ (q - z)). With fp16
            # activations q - z is formed without an int->float conversion per element: OR q
            # into the mantissa of 1024.0 (0x6400) and subtract 1024 + z.
            if MAGIC_F16:
                w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024).to(tl.float16)
                if DOT_F32:
                    part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(x, w)
            elif DOT_F32:
                part = tl.dot(x.to(tl.float32), (q - z).to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, (q - z).to(x.dtype))
            acc += part * s[None, :]
        else:
            z, s = group_zero_scale(s_ptr, z_ptr, g_ptr, offs_k, offs_n, k_mask, n_mask, group_size,
                                    stride_sg, stride_sn, stride_zg, stride_zn, AWQ, BITS, HAS_ZEROS, HAS_GIDX)
            w = (q - z).to(tl.float32) * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    finish_tile(acc, y_ptr, offs_m, offs_n, m_mask[:, None] & n_mask[None, :], stride_ym, stride_yn, ws_ptr, lock_ptr,
                pid_m, pid_n, pid_k, BLOCK_M, BLOCK_N, SPLIT_K)


def tiled_matmul(
    x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, *, bits: int, group_size: int, awq: bool, cfg: MatmulConfig,
) -> torch.Tensor:
    """``x2 [M, K] @ W [K, N]`` (layouts in ``common``); ``cfg`` passed ``can_implement``."""
    m, k = x2.shape
    n = scales.shape[1]
    one_group = g_idx is None and group_size % cfg.block_k == 0
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    y, ws, locks = split_k_output(m, n, x2.dtype, x2.device, cfg.split_k, grid[0] * grid[1], cfg.block_m * cfg.block_n)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    gidx = g_idx if g_idx is not None else qweight
    _int_matmul_kernel[grid](
        x2, qweight, scales, zeros, gidx, y, ws, locks,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1) if zeros.dim() > 1 else 0, y.stride(0), y.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, HAS_GIDX=g_idx is not None,
        ONE_GROUP_PER_TILE=one_group, SPLIT_K=cfg.split_k,
        DOT_F32=INTERPRET or x2.dtype == torch.float32, MAGIC_F16=x2.dtype == torch.float16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
