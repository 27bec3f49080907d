"""INT4/INT8 GEMV (one activation row) for the GPTQ and AWQ layouts, without tensor cores.

Same packed layouts as ``quant_matmul`` (see its docstring); these kernels serve M = 1 with
no ``g_idx`` and a K tile inside one quantization group, which is decode at batch 1, where
the whole cost is streaming the weight once.

Why not ``tl.dot``: it needs the unpacked weight tile in an MMA operand layout, and forming
it (unpack, reshape, convert layout through shared memory) costs more than the arithmetic
at M = 1. Two kernels:

- ``_gptq_gemv_kernel`` (GPTQ layout, the default): a [words, columns] tile of packed words
  and a [words, columns] fp32 accumulator carried across the K loop, summed over words once
  at the end. Value j of a word is taken *in place*, without shifting it down:
  ``(word | M) & (M | 0xF << 4j)`` with M the bits of 2.0**23 is the float 2**23 + q * 16**j,
  so one AND and one subtraction of 2**23 give ``q * 16**j`` exactly; the 16**-j goes into
  the activation (once per row, shared by all columns), and the zero point is applied once
  per word and column: ``sum_j x_j (q_j - z) = sum_j x_j q_j - z sum_j x_j``. Values 4..7
  come from the word's upper half, shifted down once per word. Per weight this leaves an
  AND, a subtraction and a multiply-add: 4.3-4.5 SASS instructions per weight in the loop
  against 6.1-6.2 for the kernel below at the default 128x128 tile (sm_80-sm_90, Triton 3.9;
  ``benchmarks/kernel_sass.py``).
  ``M`` reaches the kernel as a runtime argument (``magic``): as a literal, ptxas folds the
  OR back into every value's LOP3 and re-materializes the constant before each one.
- ``_int_gemv_kernel`` (AWQ layout, and GPTQ with ``MatmulConfig(lean=False)``): the words
  are unpacked by shifts into a 3-D tile [words, values per word, columns] (GPTQ) or [rows,
  words, values per word] (AWQ), the activations loaded in the matching shape, and the
  products summed per tile: no reshape, no shared memory. ``q - z`` is formed without an
  int->float conversion: OR q into the mantissa of 2**23 and subtract 2**23 + z. The group
  scale multiplies the tile's partial sums, not each weight.

The K loop is pipelined with ``tl.range(..., num_stages=config.num_stages)``: the kernel
argument ``num_stages`` pipelines only loads that feed ``tl.dot`` (Triton's documentation of
``tl.range``), and until 2026-12-01 these kernels had no other, so each program waited for
every tile's words in turn (no LDGSTS in their SASS at any stage count; the tl.dot kernels
and the FP8 matmul had them). On the H200 the 4096x14336 GEMV then ran at about half the
issue rate its instruction count allows (``benchmarks/NOTES-kernels.md``), while the
pipelined FP8 matmul streamed 3.4 TB/s at N = 128256 against 1.65 for INT4. Pipelined, the
words of the next tile arrive by async copy (LDGSTS) during this tile's arithmetic, at +4-6%
loop instructions with Triton 3.9 and +6-20% with 3.6 (the staged words read back from shared
memory; sm_90, 2 stages, ``kernel_sass.py``).
The default is 2 stages: a tile's arithmetic (~500 instructions per warp, 4-5 warps per
scheduler) outlasts a load's latency, so one tile ahead should cover it, at fewer instructions
than 3. Not yet timed: ``kernels.py`` prints ``int4-nopipe`` (one stage) beside the default,
and the tuner tries 1, 2 and 3 stages.
"""

import torch

from qpage.kernels.quant_matmul import MatmulConfig, col_shift, col_zero_scale
from qpage.kernels.split_k import finish_split_k, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton


@triton.jit
def _int_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
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
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):  # see the module docstring
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
                   BLOCK_N, SPLIT_K, SERIAL)


MAGIC = 0x4B000000
"""Bits of the float 2.0**23: OR-ed over a value < 2**23 they give the float 2**23 + value."""


@triton.jit
def _split8(x):
    """Columns 0..7 of ``x`` [rows, 8] as 8 vectors [rows]."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))  # columns 0,2,4,6 / 1,3,5,7
    e04, e26 = tl.split(tl.reshape(even, (x.shape[0], 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (x.shape[0], 2, 2)))
    c0, c4 = tl.split(e04)
    c2, c6 = tl.split(e26)
    c1, c5 = tl.split(o15)
    c3, c7 = tl.split(o37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _split4(x):
    """Columns 0..3 of ``x`` [rows, 4] as 4 vectors [rows]."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # columns 0,2 / 1,3
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _value(word, mask):
    """``q * 2**shift`` (exact, fp32) of the value under ``mask = M | QMASK << shift``."""
    return ((word | 0x4B000000) & mask).to(tl.float32, bitcast=True) - 8388608.0  # M = MAGIC


@triton.jit
def _gptq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size, magic,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    QMASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, PACK)
    x_shift = 1.0 / (1 << ((j % (PACK // 2)) * BITS)).to(tl.float32)  # undoes value j's 16**j
    # The masks of the values in each half-word, as runtime values (see the module docstring).
    m0 = magic | QMASK
    m1 = magic | (QMASK << BITS)
    m2 = magic | ((QMASK << (2 * BITS)) & 0xFFFF)  # 4-bit only (0 for 8 bits: unused)
    m3 = magic | ((QMASK << (3 * BITS)) & 0xFFFF)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):  # see the module docstring
        grp = (t * BLOCK_K) // group_size
        offs_kp = t * WORDS + tl.arange(0, WORDS)
        kp_mask = offs_kp < tl.cdiv(K, PACK)
        lo = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=kp_mask[:, None] & n_mask[None, :], other=0)
        hi = (lo.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        ks = offs_kp[:, None] * PACK + j[None, :]
        xt = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [WORDS, PACK]
        x_sum = tl.sum(xt, axis=1)
        xt = xt * x_shift[None, :]
        if BITS == 4:
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt)
            part = x0[:, None] * _value(lo, m0)
            part += x1[:, None] * _value(lo, m1)
            part += x2[:, None] * _value(lo, m2)
            part += x3[:, None] * _value(lo, m3)
            part += x4[:, None] * _value(hi, m0)
            part += x5[:, None] * _value(hi, m1)
            part += x6[:, None] * _value(hi, m2)
            part += x7[:, None] * _value(hi, m3)
        else:
            x0, x1, x2, x3 = _split4(xt)
            part = x0[:, None] * _value(lo, m0)
            part += x1[:, None] * _value(lo, m1)
            part += x2[:, None] * _value(hi, m0)
            part += x3[:, None] * _value(hi, m1)
        z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                              False, BITS, HAS_ZEROS)
        acc += (part - x_sum[:, None] * z.to(tl.float32)[None, :]) * s[None, :]
    finish_split_k(tl.sum(acc, axis=0), y_ptr + offs_n, n_mask, tl.arange(0, BLOCK_N), ws_ptr, lock_ptr, pid_n,
                   tl.num_programs(0), pid_k, BLOCK_N, SPLIT_K, SERIAL)


def int_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *,
    bits: int, group_size: int, awq: bool, config: MatmulConfig,
) -> torch.Tensor:
    """``x [1, K] @ W [K, N]``; the caller (``int_matmul``) checked that a GEMV applies. The
    kernel: half2 (``quant_gemv_h2``) when ``config.half2`` and it applies, else in-place for
    the GPTQ layout (``config.lean``), else shifts."""
    from qpage.kernels import quant_gemv_h2

    k = x.shape[1]
    n = scales.shape[1]
    split = config.split_k
    grid = (triton.cdiv(n, config.block_n), split)
    y, ws, locks, serial = split_k_output(1, n, x.dtype, x.device, split, config.serial, grid[0], config.block_n)
    zeros = qzeros if qzeros is not None else qweight
    head = (x, qweight, scales, zeros, y, ws, locks, n, k, group_size)
    strides = (x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
               zeros.stride(0), zeros.stride(1))
    meta = dict(BITS=bits, HAS_ZEROS=qzeros is not None, SPLIT_K=split, SERIAL=serial, BLOCK_N=config.block_n,
                BLOCK_K=config.block_k, LOOP_STAGES=config.num_stages, num_warps=config.num_warps,
                num_stages=config.num_stages)
    if config.half2 and quant_gemv_h2.h2_applies(x, bits, awq):
        quant_gemv_h2._gptq_h2_gemv_kernel[grid](*head, *strides, ASM=not INTERPRET, **meta)
    elif not awq and config.lean:
        _gptq_gemv_kernel[grid](*head, MAGIC, *strides, **meta)
    else:
        _int_gemv_kernel[grid](*head, *strides, AWQ=awq, **meta)
    return y.to(x.dtype)
