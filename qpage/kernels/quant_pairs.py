"""INT4 dequant-matmul for decode batches (2 <= M <= 32) on the GPTQ layout, values taken in pairs.

Same packed layout as ``quant_matmul`` (qweight int32 [K / 8, N], value j of a word at bits
4j). Applies to 4-bit weights without ``g_idx`` whose K tile (128 or more) lies inside one
quantization group, with fp16, bf16 or fp32 activations; ``int_matmul`` routes there when
``MatmulConfig.pairs`` is set and falls back to its own tl.dot kernel otherwise.

What the general tl.dot kernel does per weight (``benchmarks/kernel_sass.py --small-m``):
it unpacks each word into 8 values, reshapes [words, 8, N] into [K, N], converts each value
to the activation dtype on its own and stores it to shared memory on its own (one 16-bit
STS per weight), for 5.9-8.2 SASS instructions per weight at M <= 16 on sm_80-sm_90.

Here no reshape is needed, because a dot's reduction order is free: the tile's K is taken
as 8 slices, slice j holding value j of every word (rows 8w + j), and the activations are
split the same way. So y += sum_j x[:, j::8] @ (q_j - z), eight tl.dot calls of K = words.
Values j and j + 4 sit 16 bits apart, so one shift and one AND-OR,
``((word >> 4j) & 0x000F000F) | 0x64006400``, leaves two fp16 1024 + q_j and 1024 + q_{j+4},
and one packed subtraction of 1024 + z gives q - z exactly. The tiles keep the loaded
words' layout (consecutive columns in a thread), so their shared-memory stores are vector
stores. The group's scale multiplies the tile's fp32 partial sum, as in ``quant_matmul``.
With bf16 activations the integers q - z are converted to bf16 (exact) before the dot; the
same trick in bf16 (128.0, ``0x4300``) would save that conversion, but the interpreter's
bf16 arithmetic is wrong (128 - 136 comes out NaN), so such code could not be tested here.

Static counts, 4 warps (``benchmarks/reference/cpu-2026-11-30/kernel_sass_small_m.log``),
SASS instructions per weight in the loop on sm_80/86/89/90 with fp16 activations:
4.4-4.5 at 16x128x128 against 5.9-6.7 for the general kernel on that tile and 7.3-8.2 on its
former default 16x64x128; at 32 rows 5.3-5.5 (32x128x128) against 9.9-10.8 (the former
32x64x64 default). With bf16 activations: 5.7-5.8 at 16x128x128 against 6.4-7.4 and
7.9-9.0, and 6.7-6.8 at 32 rows against 10.7-12.1. These are instruction counts, not
times: no GPU was lent when this was written.
"""

import torch

from qpage.kernels.quant_gemv import _split8
from qpage.kernels.quant_matmul import MatmulConfig
from qpage.kernels.split_k import finish_split_k, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton

PAIRS_MIN_BLOCK_K = 128
"""A K tile gives each of its 8 slices K / 8 rows, and tl.dot needs at least 16."""


@triton.jit
def _pair(packed, J: tl.constexpr, zf, MAGIC2: tl.constexpr):
    """(q - z) of values J and J + 4 of each word, as two fp16 tiles shaped like ``packed``."""
    two = ((packed >> (4 * J)) & 0x000F000F) | MAGIC2
    lo = (two & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) - zf
    hi = (two >> 16).to(tl.int16).to(tl.float16, bitcast=True) - zf
    return lo, hi


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w: fp32 operands (exact products) under DOT_F32, else w in x's dtype (the
    integers q - z are exact in fp16 and bf16 alike)."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _int4_pairs_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    MAGIC2: tl.constexpr = 0x64006400  # two fp16 1024.0
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
        grp = (t * BLOCK_K) // group_size
        offs_kp = t * WORDS + tl.arange(0, WORDS)
        packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_kp < tl.cdiv(K, 8))[:, None] & n_mask[None, :], other=0)
        s = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zp = tl.load(z_ptr + grp * stride_zg + (offs_n // 8) * stride_zn, mask=n_mask, other=0)
            z = (zp >> ((offs_n % 8) * 4)) & 0xF
        else:
            z = tl.full((BLOCK_N,), 8, dtype=tl.int32)
        zf = (z + 1024).to(tl.float16)[None, :]
        # Activations [BLOCK_M, WORDS, 8] (row 8w + j of the tile at [:, w, j]), split into the 8 slices.
        ks = (offs_kp * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]
        xt = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + ks * stride_xk,
                     mask=m_mask[:, None, None] & (ks < K), other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(xt, (BLOCK_M * WORDS, 8)))
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_lo, w_hi = _pair(packed, 0, zf, MAGIC2)
        part = _dot(tl.reshape(x0, (BLOCK_M, WORDS)), w_lo, part, DOT_F32)
        part = _dot(tl.reshape(x4, (BLOCK_M, WORDS)), w_hi, part, DOT_F32)
        w_lo, w_hi = _pair(packed, 1, zf, MAGIC2)
        part = _dot(tl.reshape(x1, (BLOCK_M, WORDS)), w_lo, part, DOT_F32)
        part = _dot(tl.reshape(x5, (BLOCK_M, WORDS)), w_hi, part, DOT_F32)
        w_lo, w_hi = _pair(packed, 2, zf, MAGIC2)
        part = _dot(tl.reshape(x2, (BLOCK_M, WORDS)), w_lo, part, DOT_F32)
        part = _dot(tl.reshape(x6, (BLOCK_M, WORDS)), w_hi, part, DOT_F32)
        w_lo, w_hi = _pair(packed, 3, zf, MAGIC2)
        part = _dot(tl.reshape(x3, (BLOCK_M, WORDS)), w_lo, part, DOT_F32)
        part = _dot(tl.reshape(x7, (BLOCK_M, WORDS)), w_hi, part, DOT_F32)
        acc += part * s[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    finish_split_k(acc, y_ptrs, m_mask[:, None] & n_mask[None, :], local, ws_ptr, lock_ptr,
                   pid_m * tl.num_programs(1) + pid_n, tl.num_programs(0) * tl.num_programs(1), pid_k,
                   BLOCK_M * BLOCK_N, SPLIT_K, SERIAL)


def pairs_apply(x: torch.Tensor, bits: int, awq: bool, has_g_idx: bool, group_size: int, block_k: int) -> bool:
    """Whether ``int4_pairs_matmul`` serves this call (module docstring)."""
    return (bits == 4 and not awq and not has_g_idx and block_k % PAIRS_MIN_BLOCK_K == 0
            and group_size % block_k == 0 and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def int4_pairs_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                      *, group_size: int, config: MatmulConfig) -> torch.Tensor:
    """``x [M, K] @ W [K, N]``; the caller checked ``pairs_apply``."""
    m, k = x.shape
    n = scales.shape[1]
    cfg = config
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    y, ws, locks, serial = split_k_output(m, n, x.dtype, x.device, cfg.split_k, cfg.serial, grid[0] * grid[1],
                                          cfg.block_m * cfg.block_n)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    _int4_pairs_kernel[grid](
        x, qweight, scales, zeros, y, ws, locks, m, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), y.stride(0), y.stride(1),
        HAS_ZEROS=qzeros is not None, SPLIT_K=cfg.split_k, SERIAL=serial,
        DOT_F32=INTERPRET or x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.to(x.dtype)
