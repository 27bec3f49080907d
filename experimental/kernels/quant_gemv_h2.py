"""INT4/INT8 GEMV (M = 1, GPTQ layout, fp16/bf16 activations) in packed fp16 pairs: two weights per instruction.

Why: the in-place GEMV (``quant_gemv``) spends 4.3-4.5 SASS instructions per weight in its
loop, three of them fp32 (an AND, a subtraction, an FMA), and on an H200 its time follows
instructions rather than bytes (docs/kernels.md: 23 us for 4096x14336,
against ~7 us to stream the weight). Here every instruction of the per-weight work handles
two weights, the way ExLlama and Marlin work on CUDA cores:

- Values j and j + 4 of a word sit 16 bits apart. For j = 0, 1 one LOP3,
  ``(word & (0xF << 4j) * 0x10001) | 0x64006400``, leaves the two fp16 1024 + q * 16**j in
  place (the fp16 mantissa holds bits 0-9); values 2, 3, 6 and 7 come the same way after one
  shift of the word by 8.
- One ``sub.f16x2`` of 1024 + z (j even), or one ``fma.rn.f16x2`` by 1/16 minus 64 + z
  (j odd), gives the two q - z exactly.
- ``fma.rn.f16x2`` with the activation pair (x_j, x_{j+4}) accumulates the word's 8
  products in two fp16 lanes; the lanes are added (fp16), converted to fp32 once per word,
  and the K loop accumulates in fp32.
- The activations of each word are first scaled by a power of two that puts their largest
  magnitude in [1, 2): the fp16 products and sums stay below 8 * 15 * 2 = 240 (no overflow,
  whatever the activations' range), and the power of two returns exactly in fp32.

Per word and column that is 4 LOP3, 1 shift, 2 subtractions, 6 packed FMAs/multiplies, an
add, a conversion and two fp32 operations (the word's power of two and the group scale):
about 2.1 instructions per weight plus loads, against 4.3-4.5
(``benchmarks/kernel_sass.py`` prints both).

8-bit words (``WORD_SUMS8_PTX``) hold 4 values; values j and j + 2 pair up under
``0x00FF00FF`` (1024 + q is exact in fp16 for q < 1024; values 1 and 3 after a shift by 8),
so a word costs 2 LOP3, a shift, 2 subtractions, a multiply and an FMA, and the per-word
add, conversion and fp32 work weigh twice as much per weight: about 4.0-4.3 per weight
against the in-place kernel's 5.1-5.3.

Numerics: each word's 8 products are rounded and summed in fp16 (unit roundoff 2**-11 per
operation, relative to the word's partial sum, about the output's own fp16 rounding);
across words the accumulation is fp32. That differs from the other kernels, which multiply
and accumulate in fp32, so this kernel is opt-in (``MatmulConfig(half2=True)``), picked by
a GPU's tuned table only where the sweep timed it faster and its result matched the
reference, until a GPU run says it should be the default.

The interpreter cannot run inline assembly; there the same arithmetic runs as Triton fp16
operations (``_word_sums_emulated``, fused like the PTX), and ``h2_gemv_ref`` is that
arithmetic in torch. ``tests/kernels/test_quant_gemv_h2.py`` executes the PTX text below
instruction by instruction (a numpy model of its opcodes) and holds it bit for bit to the
same arithmetic; ``ptxas`` checks it when ``benchmarks/kernel_sass.py`` compiles the kernel.
``benchmarks/h2_numerics.py`` measures what the fp16 rounding does to the default model.
"""

import torch
from qpage.kernels.quant_gemv import _split4, _split8
from qpage.kernels.quant_matmul import col_zero_scale

from qpage.kernels.split_k import finish_split_k, split_k_range
from qpage.kernels.triton_utils import tl, triton

WORD_SUMS_PTX = tl.constexpr("""
{
.reg .b32 t, a, w8, c16;
.reg .f16 lo, hi, s;
mov.b32 c16, 0x2C002C00;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
sub.rn.f16x2 t, t, $2;
mul.rn.f16x2 a, t, $4;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, c16, $3;
fma.rn.f16x2 a, t, $5, a;
shr.u32 w8, $1, 8;
lop3.b32 t, w8, 0x000F000F, 0x64006400, 0xEA;
sub.rn.f16x2 t, t, $2;
fma.rn.f16x2 a, t, $6, a;
lop3.b32 t, w8, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 t, t, c16, $3;
fma.rn.f16x2 a, t, $7, a;
mov.b32 {lo, hi}, a;
add.rn.f16 s, lo, hi;
cvt.f32.f16 $0, s;
}
""")
"""$0 (f32) = sum over the 8 values of word $1 of (q - z) * x. $2: fp16 1024 + z in both
halves; $3: fp16 -(64 + z) in both; $4..$7: the activation pairs (x0, x4), (x1, x5), (x2, x6),
(x3, x7). LOP3 0xEA is (a & b) | c; 0x2C00 is fp16 1/16."""

WORD_SUMS8_PTX = tl.constexpr("""
{
.reg .b32 t, a, w8;
.reg .f16 lo, hi, s;
lop3.b32 t, $1, 0x00FF00FF, 0x64006400, 0xEA;
sub.rn.f16x2 t, t, $2;
mul.rn.f16x2 a, t, $3;
shr.u32 w8, $1, 8;
lop3.b32 t, w8, 0x00FF00FF, 0x64006400, 0xEA;
sub.rn.f16x2 t, t, $2;
fma.rn.f16x2 a, t, $4, a;
mov.b32 {lo, hi}, a;
add.rn.f16 s, lo, hi;
cvt.f32.f16 $0, s;
}
""")
"""8-bit words (4 values at bits 8j; 1024 + q is exact in fp16 for q < 1024): $0 (f32) = sum
over the word's values of (q - z) * x. $2: fp16 1024 + z in both halves; $3, $4: the
activation pairs (x0, x2), (x1, x3)."""

PAIR_PTX = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")
"""$0 = fp16($1) in the low half, fp16($2) in the high half (round to nearest even)."""


@triton.jit
def _pack2(lo, hi):
    """Two fp16 tensors as one int32 tensor, ``lo`` in the low half."""
    lo_bits = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo_bits | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _unpack2(pair):
    """The inverse of ``_pack2``."""
    lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _pair(lo, hi, ASM: tl.constexpr):
    """Two fp32 tensors rounded to fp16 and packed into one int32 tensor, ``lo`` in the low half
    (one ``cvt.rn.f16x2.f32`` under ASM)."""
    if ASM:
        return tl.inline_asm_elementwise(PAIR_PTX, "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _pack2(lo.to(tl.float16), hi.to(tl.float16))


@triton.jit
def _word_activations(xt, ASM: tl.constexpr):
    """xt [words, 32 / bits] fp32 -> the fp16 pairs of ``WORD_SUMS_PTX`` (4 bits, 8 values: 4
    pairs) or ``WORD_SUMS8_PTX`` (8 bits, 4 values: 2 pairs, the last two returned as 0), int32
    [words] each, and each word's power of two 2**e (fp32 [words]), with 2**-e scaling the
    word's largest |x| into [1, 2). An all-zero word gets 2**-e = 2**127 (its x stay 0) and
    2**e = 0."""
    amax = tl.max(tl.abs(xt), axis=1)
    pow_bits = amax.to(tl.int32, bitcast=True) & 0x7F800000  # the float 2**floor(log2 amax)
    inv = (0x7F000000 - pow_bits).to(tl.float32, bitcast=True)  # 2**-e: exponent 254 - (e + 127)
    word_pow = pow_bits.to(tl.float32, bitcast=True)
    if xt.shape[1] == 8:
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt * inv[:, None])
        return _pair(x0, x4, ASM), _pair(x1, x5, ASM), _pair(x2, x6, ASM), _pair(x3, x7, ASM), word_pow
    else:
        x0, x1, x2, x3 = _split4(xt * inv[:, None])
        unused = tl.zeros_like(pow_bits)
        return _pair(x0, x2, ASM), _pair(x1, x3, ASM), unused, unused, word_pow


@triton.jit
def _zero_pairs(z):
    """Column zeros (int32) as the fp16 pairs 1024 + z and -(64 + z) (int32 bit patterns; the
    second only for 4-bit zeros, 0..15)."""
    return (0x6400 + z) * 0x10001, (0xD400 + (z << 4)) * 0x10001


@triton.jit
def _halves_f16(words, MASK: tl.constexpr):
    """The two fp16 of ``(words & MASK) | 0x64006400``."""
    return _unpack2((words & MASK) | 0x64006400)


@triton.jit
def _word_sums_emulated(w, z_even, z_odd, x04, x15, x26, x37):
    """``WORD_SUMS_PTX`` in Triton fp16 operations (the interpreter's path)."""
    ze, _ze = _unpack2(z_even)
    zo, _zo = _unpack2(z_odd)
    w8 = (w.to(tl.uint32, bitcast=True) >> 8).to(tl.int32, bitcast=True)
    x0, x4 = _unpack2(x04)
    x1, x5 = _unpack2(x15)
    x2, x6 = _unpack2(x26)
    x3, x7 = _unpack2(x37)
    lo, hi = _halves_f16(w, 0x000F000F)
    a_lo = (lo - ze) * x0
    a_hi = (hi - ze) * x4
    lo, hi = _halves_f16(w, 0x00F000F0)  # q - z exact either way; the accumulation rounds once per fma
    a_lo = tl.fma(lo * 0.0625 + zo, x1, a_lo)
    a_hi = tl.fma(hi * 0.0625 + zo, x5, a_hi)
    lo, hi = _halves_f16(w8, 0x000F000F)
    a_lo = tl.fma(lo - ze, x2, a_lo)
    a_hi = tl.fma(hi - ze, x6, a_hi)
    lo, hi = _halves_f16(w8, 0x00F000F0)
    a_lo = tl.fma(lo * 0.0625 + zo, x3, a_lo)
    a_hi = tl.fma(hi * 0.0625 + zo, x7, a_hi)
    return (a_lo + a_hi).to(tl.float32)


@triton.jit
def _word_sums8_emulated(w, z_pair, x02, x13):
    """``WORD_SUMS8_PTX`` in Triton fp16 operations (the interpreter's path)."""
    ze, _ze = _unpack2(z_pair)
    w8 = (w.to(tl.uint32, bitcast=True) >> 8).to(tl.int32, bitcast=True)
    x0, x2 = _unpack2(x02)
    x1, x3 = _unpack2(x13)
    lo, hi = _halves_f16(w, 0x00FF00FF)  # values 0 and 2
    a_lo = (lo - ze) * x0
    a_hi = (hi - ze) * x2
    lo, hi = _halves_f16(w8, 0x00FF00FF)  # values 1 and 3
    a_lo = tl.fma(lo - ze, x1, a_lo)
    a_hi = tl.fma(hi - ze, x3, a_hi)
    return (a_lo + a_hi).to(tl.float32)


@triton.jit
def _word_sums(w, z, pa, pb, pc, pd, BITS: tl.constexpr, ASM: tl.constexpr):
    """fp32 [words, columns]: each word's sum of (q - z) * x (activations as scaled, in the
    pairs ``_word_activations`` returns; ``z`` the column zeros, int32)."""
    z_even, z_odd = _zero_pairs(z)
    if BITS == 4:
        if ASM:
            return tl.inline_asm_elementwise(WORD_SUMS_PTX, "=f,r,r,r,r,r,r,r", [w, z_even, z_odd, pa, pb, pc, pd],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return _word_sums_emulated(w, z_even, z_odd, pa, pb, pc, pd)
    else:
        if ASM:
            return tl.inline_asm_elementwise(WORD_SUMS8_PTX, "=f,r,r,r,r", [w, z_even, pa, pb],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return _word_sums8_emulated(w, z_even, pa, pb)


@triton.jit
def _gptq_h2_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
    ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, PACK)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):  # see quant_gemv's docstring
        grp = (t * BLOCK_K) // group_size
        offs_kp = t * WORDS + tl.arange(0, WORDS)
        kp_mask = offs_kp < tl.cdiv(K, PACK)
        w = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    mask=kp_mask[:, None] & n_mask[None, :], other=0)
        ks = offs_kp[:, None] * PACK + j[None, :]
        xt = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [WORDS, PACK]
        pa, pb, pc, pd, word_pow = _word_activations(xt, ASM)
        z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                              False, BITS, HAS_ZEROS)
        part = _word_sums(w, z[None, :], pa[:, None], pb[:, None], pc[:, None], pd[:, None], BITS, ASM)
        acc += part * (word_pow[:, None] * s[None, :])
    finish_split_k(tl.sum(acc, axis=0), y_ptr + offs_n, n_mask, tl.arange(0, BLOCK_N), ws_ptr, lock_ptr, pid_n,
                   tl.num_programs(0), pid_k, BLOCK_N, SPLIT_K, SERIAL)


def h2_applies(x: torch.Tensor, bits: int, awq: bool) -> bool:
    """The half2 GEMV serves 4- and 8-bit GPTQ-layout weights with fp16 or bf16 activations (the
    caller has checked M = 1, no ``g_idx`` and a K tile inside one group). bf16 activations
    lose nothing on the way in: scaled per word into [1, 2), their 8-bit mantissas fit fp16's
    11. fp32 activations would, so they keep the fp32 GEMV."""
    return bits in (4, 8) and not awq and x.dtype in (torch.float16, torch.bfloat16)


def _f16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to fp16 (nearest even), kept in fp32."""
    return t.to(torch.float16).float()


def h2_gemv_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *,
    group_size: int, bits: int = 4, rows_per_chunk: int = 16,
) -> torch.Tensor:
    """The kernel's arithmetic in torch, for any number of rows (GPTQ layout, 4 or 8 bits): per
    word, activations scaled by 2**-e and rounded to fp16; two lanes (the word's first and
    second half of values) accumulated by fused multiply-adds rounded to fp16; the lanes added
    in fp16, then fp32 times 2**e and the group scale, summed over words in fp32. Products
    q - z times an fp16 are exact in fp32 and so are most fused sums; the rare one that is not
    is rounded twice (fp32, then fp16). ``x [..., K]`` -> ``[..., N]`` in x's dtype."""
    from qpage.kernels.int_packing import unpack_cols, unpack_rows

    pack = 32 // bits
    lead, k = x.shape[:-1], x.shape[-1]
    n = scales.shape[1]
    words = -(-k // pack)
    q = torch.zeros(words * pack, n, dtype=torch.int32, device=qweight.device)
    q[:k] = unpack_rows(qweight, bits, k)
    z = unpack_cols(qzeros, bits, n) if qzeros is not None else torch.full_like(scales, 1 << (bits - 1),
                                                                                  dtype=torch.int32)
    grp = torch.arange(words, device=q.device) * pack // group_size
    d = (q.view(words, pack, n) - z[grp][:, None, :]).float()  # exact
    s = scales.float()[grp]  # [words, N]
    x2 = torch.zeros(x[..., :1].numel(), words * pack, dtype=torch.float32, device=x.device)
    x2[:, :k] = x.reshape(-1, k).float()
    out = []
    for xc in x2.split(rows_per_chunk):
        xw = xc.view(-1, words, pack)
        amax = xw.abs().amax(-1)
        power = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-38)))), 0.0)
        xs = _f16(xw / torch.where(power > 0, power, 1.0)[..., None])  # [rows, words, pack]
        lanes = []
        for first in (0, pack // 2):
            acc = _f16(xs[..., first, None] * d[None, :, first, :])
            for j in range(first + 1, first + pack // 2):
                acc = _f16(acc + xs[..., j, None] * d[None, :, j, :])
            lanes.append(acc)
        word_sums = _f16(lanes[0] + lanes[1])  # [rows, words, N]
        out.append((word_sums * power[..., None] * s[None]).sum(1))
    return torch.cat(out).to(x.dtype).view(*lead, n)
