"""INT4/INT8 dequant-matmul for decode batches (2 <= M <= 32), GPTQ and AWQ layouts, values taken in pairs.

Same packed layouts as ``quant_matmul``. Applies to weights without ``g_idx`` whose K tile
lies inside one quantization group (GPTQ, 4 or 8 bits: a K tile of 16 words or more, 128
rows at 4 bits and 64 at 8; AWQ, 4 bits: a column tile that is a multiple of 128), with
fp16, bf16 or fp32 activations; ``int_matmul`` routes there when ``MatmulConfig.pairs`` is
set and falls back to its own tl.dot kernel otherwise.

What the general tl.dot kernel does per weight (``benchmarks/kernel_sass.py --small-m``):
it unpacks each word into 8 values, reshapes [words, 8, N] into [K, N], converts each value
to the activation dtype on its own and stores it to shared memory on its own (one 16-bit
STS per weight), for 5.9-8.2 SASS instructions per weight at M <= 16 on sm_80-sm_90.

GPTQ (qweight int32 [K / 8, N], value j of a word at bits 4j, packed along K). Here no
reshape is needed, because a dot's reduction order is free: the tile's K is taken
as 8 slices, slice j holding value j of every word (rows 8w + j), and the activations are
split the same way. So y += sum_j x[:, j::8] @ (q_j - z), eight tl.dot calls of K = words.
Values j and j + 4 sit 16 bits apart, so one shift and one AND-OR,
``((word >> 4j) & 0x000F000F) | 0x64006400``, leaves two fp16 1024 + q_j and 1024 + q_{j+4},
and one packed subtraction of 1024 + z gives q - z exactly. 8-bit words hold 4 values, and
values j and j + 2 pair up the same way (mask ``0x00FF00FF``; fp16 holds every integer in
[1024, 2048), so 1024 + q stays exact): 4 slices, two pair operations per word. The tiles keep the loaded
words' layout (consecutive columns in a thread), so their shared-memory stores are vector
stores. The group's scale multiplies the tile's fp32 partial sum, as in ``quant_matmul``.

AWQ (qweight int32 [K, N / 8], packed along N, nibble i holding column 0,2,4,6,1,3,5,7[i]):
the same AND-OR on nibbles j and j + 4 gives columns 2j and 2j + 1 of every word, the
interleave AWQ was designed for. Output columns may be permuted as freely as K, so the
column tile is taken as 8 slices (slice i = column i of every word), each one tl.dot of
the whole activation tile against [K tile, words] with its own zeros (unpacked from the
zero words by the same trick) and scales, into 8 accumulators joined into column order at
the end. Each slice must be 16 columns wide for tl.dot, and with 4 warps MMAs are only
unduplicated from 32 (so 256-column tiles).

With bf16 activations the integers q - z are converted to bf16 (exact) before the dot; the
same trick in bf16 (128.0, ``0x4300``) would save that conversion, but the interpreter's
bf16 arithmetic is wrong (128 - 136 comes out NaN), so such code could not be tested here.

Static counts, 4 warps (docs/kernels.md),
SASS instructions per weight in the loop on sm_80/86/89/90 with fp16 activations:
4.4-4.5 at 16x128x128 against 5.9-6.7 for the general kernel on that tile and 7.3-8.2 on its
former default 16x64x128; at 32 rows 5.3-5.5 (32x128x128) against 9.9-10.8 (the former
32x64x64 default). With bf16 activations: 5.7-5.8 at 16x128x128 against 6.4-7.4 and
7.9-9.0, and 6.7-6.8 at 32 rows against 10.7-12.1. AWQ at 16x256x128: 4.4-4.6 (bf16:
5.8-5.9) against 8.8-9.7 (bf16: 9.8-10.6) at the former default 16x64x128. At 32 rows the
AWQ kernel spills (sm_89), so AWQ takes it for M <= 16 only. INT8 per-channel (fp16): 4.5-4.8
at 16x128x128 and 5.3-5.7 at 32 rows against 7.1-8.3 and 9.4-10.0 at the former defaults;
with bf16 on sm_90 the general kernel on the same tiles counts slightly fewer (5.6 and 6.4
against 5.9 and 6.8), still below the former defaults' 7.9 and 10.0. These are instruction
counts, not times: no GPU was lent when this was written.
"""

import torch
from qpage.kernels.quant_gemv import _split4, _split8
from qpage.kernels.quant_matmul import PAIRS_MIN_WORDS, MatmulConfig, col_zero_scale

from qpage.kernels.split_k import finish_tile, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton

AWQ_MIN_BLOCK_N = 128
"""AWQ: a column tile gives each of its 8 slices BLOCK_N / 8 columns, and tl.dot needs 16."""


@triton.jit
def _halves(words, J: tl.constexpr, BITS: tl.constexpr = 4):
    """Values J and J + 16 / BITS of int32 words (4 or 8 bits each) as two fp16 tensors,
    1024 + value each (exact: fp16 holds every integer in [1024, 2048))."""
    MASK2: tl.constexpr = 0x000F000F if BITS == 4 else 0x00FF00FF
    two = ((words >> (BITS * J)) & MASK2) | 0x64006400  # two fp16 1024.0
    lo = (two & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (two >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _slices(part, xt, packed, zf, J: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr,
            DOT_F32: tl.constexpr):
    """part + the products of value slices J and J + 16 / BITS (``xt``: the activations of
    every slice, [BLOCK_M * WORDS, 32 / BITS])."""
    lo, hi = _halves(packed, J, BITS)
    if BITS == 4:
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt)
        if J == 0:
            x_lo, x_hi = x0, x4
        elif J == 1:
            x_lo, x_hi = x1, x5
        elif J == 2:
            x_lo, x_hi = x2, x6
        else:
            x_lo, x_hi = x3, x7
    else:
        x0, x1, x2, x3 = _split4(xt)
        if J == 0:
            x_lo, x_hi = x0, x2
        else:
            x_lo, x_hi = x1, x3
    part = _dot(tl.reshape(x_lo, (BLOCK_M, WORDS)), lo - zf, part, DOT_F32)
    return _dot(tl.reshape(x_hi, (BLOCK_M, WORDS)), hi - zf, part, DOT_F32)


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w: fp32 operands (exact products) under DOT_F32, else w in x's dtype (the
    integers q - z are exact in fp16 and bf16 alike)."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _gptq_pairs_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
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
                         mask=(offs_kp < tl.cdiv(K, PACK))[:, None] & n_mask[None, :], other=0)
        z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                              False, BITS, HAS_ZEROS)
        zf = (z + 1024).to(tl.float16)[None, :]
        # Activations [BLOCK_M, WORDS, PACK] (row PACK * w + j of the tile at [:, w, j]), as
        # [BLOCK_M * WORDS, PACK] for the split into slices.
        ks = (offs_kp * PACK)[None, :, None] + tl.arange(0, PACK)[None, None, :]
        xt = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + ks * stride_xk,
                     mask=m_mask[:, None, None] & (ks < K), other=0.0)
        xt = tl.reshape(xt, (BLOCK_M * WORDS, PACK))
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part = _slices(part, xt, packed, zf, 0, BITS, BLOCK_M, WORDS, DOT_F32)
        part = _slices(part, xt, packed, zf, 1, BITS, BLOCK_M, WORDS, DOT_F32)
        if BITS == 4:
            part = _slices(part, xt, packed, zf, 2, BITS, BLOCK_M, WORDS, DOT_F32)
            part = _slices(part, xt, packed, zf, 3, BITS, BLOCK_M, WORDS, DOT_F32)
        acc += part * s[None, :]
    finish_tile(acc, y_ptr, offs_m, offs_n, m_mask[:, None] & n_mask[None, :], stride_ym, stride_yn, ws_ptr, lock_ptr,
                pid_m, pid_n, pid_k, BLOCK_M, BLOCK_N, SPLIT_K, SERIAL)


@triton.jit
def _awq_pair(x, packed, zp, s_ptrs, c_mask, acc_lo, acc_hi, J: tl.constexpr, HAS_ZEROS: tl.constexpr,
              DOT_F32: tl.constexpr):
    """AWQ nibbles J and J + 4 of each word: columns 8c + 2J and 8c + 2J + 1 (module docstring)."""
    w_lo, w_hi = _halves(packed, J)
    if HAS_ZEROS:
        z_lo, z_hi = _halves(zp, J)
    else:
        z_lo = tl.full(zp.shape, 1032.0, dtype=tl.float16)  # 1024 + 8
        z_hi = z_lo
    s_lo = tl.load(s_ptrs + 2 * J, mask=c_mask, other=0.0).to(tl.float32)
    s_hi = tl.load(s_ptrs + 2 * J + 1, mask=c_mask, other=0.0).to(tl.float32)
    acc_lo += _dot(x, w_lo - z_lo[None, :], tl.zeros_like(acc_lo), DOT_F32) * s_lo[None, :]
    acc_hi += _dot(x, w_hi - z_hi[None, :], tl.zeros_like(acc_hi), DOT_F32) * s_hi[None, :]
    return acc_lo, acc_hi


@triton.jit
def _awq_pairs_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_N // 8  # words of a row in the tile; accumulator i holds columns 8c + i
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_n * C + tl.arange(0, C)
    m_mask = offs_m < M
    c_mask = offs_c < tl.cdiv(N, 8)
    a0 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a5 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a6 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    a7 = tl.zeros((BLOCK_M, C), dtype=tl.float32)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    for t in range(t_start, t_end):
        grp = (t * BLOCK_K) // group_size
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        packed = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_c[None, :] * stride_qn,
                         mask=k_mask[:, None] & c_mask[None, :], other=0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        zp = tl.load(z_ptr + grp * stride_zg + offs_c * stride_zn, mask=c_mask & HAS_ZEROS, other=0)
        s_ptrs = s_ptr + grp * stride_sg + (offs_c * 8) * stride_sn
        a0, a1 = _awq_pair(x, packed, zp, s_ptrs, c_mask, a0, a1, 0, HAS_ZEROS, DOT_F32)
        a2, a3 = _awq_pair(x, packed, zp, s_ptrs, c_mask, a2, a3, 1, HAS_ZEROS, DOT_F32)
        a4, a5 = _awq_pair(x, packed, zp, s_ptrs, c_mask, a4, a5, 2, HAS_ZEROS, DOT_F32)
        a6, a7 = _awq_pair(x, packed, zp, s_ptrs, c_mask, a6, a7, 3, HAS_ZEROS, DOT_F32)
    # Column 8c + 4 b2 + 2 b1 + b0 of the tile: join over b2, then b1, then b0 (the last join's
    # axis is the innermost), so the reshape lays the columns out in order.
    acc = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
    acc = tl.reshape(acc, (BLOCK_M, BLOCK_N))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    finish_tile(acc, y_ptr, offs_m, offs_n, m_mask[:, None] & (offs_n < N)[None, :], stride_ym, stride_yn,
                ws_ptr, lock_ptr, pid_m, pid_n, pid_k, BLOCK_M, BLOCK_N, SPLIT_K, SERIAL)


def pairs_apply(x: torch.Tensor, bits: int, awq: bool, has_g_idx: bool, group_size: int, config: MatmulConfig
                ) -> bool:
    """Whether ``pairs_matmul`` serves this call (module docstring)."""
    if bits not in (4, 8) or has_g_idx or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if group_size % config.block_k:
        return False
    if awq:  # each of the 8 dots is BLOCK_N / 8 columns wide, and tl.dot needs 16
        return bits == 4 and config.block_n % AWQ_MIN_BLOCK_N == 0 and config.block_k >= 16
    return config.block_k % (PAIRS_MIN_WORDS * 32 // bits) == 0


def pairs_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 *, bits: int, group_size: int, awq: bool, config: MatmulConfig) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` (GPTQ or AWQ layout); the caller checked ``pairs_apply``."""
    m, k = x.shape
    n = scales.shape[1]
    cfg = config
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    y, ws, locks, serial = split_k_output(m, n, x.dtype, x.device, cfg.split_k, cfg.serial, grid[0] * grid[1],
                                          cfg.block_m * cfg.block_n)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    kernel = _awq_pairs_kernel if awq else _gptq_pairs_kernel
    layout = {} if awq else {"BITS": bits}
    kernel[grid](
        x, qweight, scales, zeros, y, ws, locks, m, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), y.stride(0), y.stride(1),
        HAS_ZEROS=qzeros is not None, SPLIT_K=cfg.split_k, SERIAL=serial,
        DOT_F32=INTERPRET or x.dtype == torch.float32, **layout,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.to(x.dtype)
