"""FP8 (E4M3) weight-only matmul: ``y = x @ (W * scale)^T`` with W stored as uint8 codes.

Layout (HF fp8 / compressed-tensors): ``weight`` [N, K] E4M3 codes (a
``float8_e4m3fn`` tensor viewed as uint8), row n = output feature; scales fp32 either
per channel, ``[N]`` (or ``[N, 1]``), or per 128x128 block, ``[ceil(N/128), ceil(K/128)]``
(HF's ``weight_scale_inv``, which despite its name multiplies). Codes are decoded in
registers (``codec``: the integer bit trick on GPUs without FP8 units such as sm_80/86, the
hardware conversion on sm_89+), so the kernel runs on every GPU generation. Tiles and split-K
as the integer ``tiled`` kernel's (``configs.MatmulConfig``). There is no dequantize-then-cuBLAS
path: by an estimate from GPU timings the fused kernel is the faster of the two at M=256
(docs/kernels.md).
"""

import functools
from dataclasses import replace

import torch

from qpage.kernels.configs import MatmulConfig, default_matmul_config
from qpage.kernels.fp8.codec import decode_fp8_ref, fp8_decoder, fp8_to_f16, fp8_unit
from qpage.kernels.split_k import finish_tile, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton
from qpage.kernels.tuned import on_install, tuned_matmul_config

SCALE_BLOCK = 128


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
    unit,
    BLOCK_SCALES: tl.constexpr, SCALE_BLOCK_: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr, FP8_CVT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        codes = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
        w = fp8_to_f16(codes, False, FP8_CVT)  # value / unit
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        if BLOCK_SCALES:  # the tile lies in one 128x128 scale block along K: scale per column
            kb = (t * BLOCK_K) // SCALE_BLOCK_
            s = tl.load(s_ptr + (offs_n // SCALE_BLOCK_) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            acc += part * s.to(tl.float32)[None, :]
        else:
            acc += part
    if BLOCK_SCALES:
        acc = acc * unit
    else:
        s = tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0)
        acc = acc * (s.to(tl.float32) * unit)[None, :]
    finish_tile(acc, y_ptr, offs_m, offs_n, m_mask[:, None] & n_mask[None, :], stride_ym, stride_yn, ws_ptr, lock_ptr,
                pid_m, pid_n, pid_k, BLOCK_M, BLOCK_N, SPLIT_K)


def _is_block_scale(scale: torch.Tensor, n: int) -> bool:
    return not (scale.dim() == 1 or (scale.dim() == 2 and scale.shape == (n, 1)))


@functools.lru_cache(maxsize=4096)
def choose_config(device: torch.device, block_scales: bool, m: int, n: int, k: int) -> MatmulConfig:
    """This GPU's tuned tiles for the problem, else the default tiles of its regime; always the
    ``tiled`` kind (this is the one FP8 kernel)."""
    kind = "fp8-block" if block_scales else "fp8-chan"
    cfg = tuned_matmul_config(device, kind, m, n, k) or default_matmul_config(m, n, k, device)
    return replace(cfg, kind="tiled")


on_install(choose_config.cache_clear)


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x [..., K]`` times FP8 ``weight`` [N, K] (uint8 or float8_e4m3fn) with ``scale``."""
    codes = weight.view(torch.uint8)
    n, k = codes.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    block = _is_block_scale(scale, n)
    cfg = config or choose_config(x.device, block, m, n, k)
    if block and (SCALE_BLOCK % cfg.block_k or SCALE_BLOCK % cfg.block_n):
        raise ValueError(f"block scales need block_k and block_n to divide {SCALE_BLOCK}")
    s2 = scale if block else scale.reshape(n, 1)
    split = cfg.split_k
    cvt = fp8_decoder(x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    y, ws, locks = split_k_output(m, n, x.dtype, x.device, split, grid[0] * grid[1], cfg.block_m * cfg.block_n)
    _fp8_matmul_kernel[grid](
        x2, codes, s2, y, ws, locks, m, n, k,
        x2.stride(0), x2.stride(1), codes.stride(0), codes.stride(1), s2.stride(0), s2.stride(1),
        y.stride(0), y.stride(1), fp8_unit("e4m3", cvt),
        BLOCK_SCALES=block, SCALE_BLOCK_=SCALE_BLOCK, SPLIT_K=split,
        DOT_F32=INTERPRET or x.dtype == torch.float32, FP8_CVT=cvt,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.view(*lead, n)


def dequantize_fp8_weight_ref(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] from E4M3 codes and per-channel or 128x128 block scales."""
    w = decode_fp8_ref(weight.view(torch.uint8), "e4m3")
    n, k = w.shape
    if not _is_block_scale(scale, n):
        return w * scale.float().reshape(n, 1)
    full = scale.float().repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
    return w * full[:n, :k]


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ dequantize_fp8_weight_ref(weight, scale).T).to(x.dtype)
