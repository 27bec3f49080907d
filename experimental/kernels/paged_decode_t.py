"""Paged decode attention over an FP8 e4m3 cache with the tokens as the MMA's rows.

``paged_attention._decode_kernel`` computes S = q K^T with the query heads of one KV head as
the MMA's rows: 4 heads (Llama-3-8B's GQA) padded to 16 rows, the tokens as its columns.
There every FP8 code passes through registers to become an fp16 operand, each warp reloads
q from shared memory per tile, and on sm_90 the small M rules out wgmma. This kernel
computes the transpose, S^T = K q^T: 64 tokens are the rows (one warpgroup's wgmma M) and
the heads, padded to 8, the columns. Then

- **QK^T in FP8** (``QK_FP8``, sm_89+): K's codes go from shared memory straight into the
  FP8 MMA (QGMMA on sm_90, mma.sync e4m3 on sm_89): nothing is converted per tile. q is
  split once per program into two e4m3 parts with a scale per head each, q ~ hi * u_hi +
  lo * u_lo (lo: hi's rounding error), so S^T takes two FP8 MMAs with N = 8, and q keeps
  about 8 significant bits where e4m3 alone keeps 4. On the default model (16 x 512 tokens
  of wikitext-2, ``benchmarks/kv_cache.py --q-fp8``) e4m3 queries took the per-token FP8
  cache's mean KL from the ``auto`` cache from 2.72e-3 to 5.64e-3, hi + lo to 2.80e-3
  (perplexity +0.044% over ``auto``, against +0.078% with exact queries: noise);
  ``quantize_queries_ref`` is the arithmetic. Off, K's codes are decoded to fp16 in
  registers (the A operand) and q stays fp16.
- **Per-token scales per row**: a row of S^T is one token, so each thread needs the K and V
  scales of its own few rows (the other kernel needs the scales of every score column it
  holds). V's scale multiplies P^T's rows (with P kept in fp16 range by a factor 2**8
  removed at the end), so V's decoded codes go to the MMA unscaled.
- **V's codes as 32-bit words**: four codes per load, decoded by two
  ``cvt.rn.f16x2.e4m3x2`` in inline PTX (or ``fp8_codec``'s packed PTX, ``_word_asm``);
  loaded as bytes, the values carried across the software pipeline were one byte per
  register and re-packed with PRMT/LOP3/IMAD per pair.

By static count (``benchmarks/kernel_sass.py --attention``: Llama-3-8B heads, 64-token tiles,
4 warps, per-token scales) the sm_90 loop is 419 instructions in 83 registers (24 warps per SM)
with QK^T in FP8 and 629 in 99 (20 warps) without, against 645 in 126 (16 warps) for the
other kernel's default there: 26 warp instructions per token against 40. sm_89: 398 against
842. With Triton 3.6-3.7 (the H200 machine had 3.6) wgmma needs 16 query columns on sm_90:
there q K^T in FP8 (474 instructions in 122 registers with ``q_pad=16``) is off by default
and the fp16 path runs on mma.sync (488 in 106; both 16 warps per SM; the default kernel: 671
in 144, 12 warps; ``default_qk_fp8``). Nothing here is timed: ``kernels.py`` times it
beside the default, and the tuned table (``decode_t``, ``qk_fp8``, ``q_pad``) or
``QPAGE_DECODE_T=1`` selects it. Under the interpreter (CPU
tests) the kernel runs with the codes decoded by the element-wise bit trick and fp32 dots;
its PTX is checked by the PTX model, and each GPU checks the whole kernel against the
reference on first use (``decode_t_ok``).

Scope: FP8 caches (e4m3, e5m2), fp16 or bf16 activations on a GPU of compute capability
8.0+ (any float dtype under the interpreter, which multiplies in fp32). q K^T in FP8 needs
e4m3 and sm_89+; elsewhere K's codes are decoded as ``fp8_codec.fp8_decoder`` chooses (the
packed PTX on sm_80/86 and for e5m2) and q K^T runs in fp16 on mma.sync. By count this pays
on sm_80 (per-token, 4 warps: 635 instructions, 16 warps per SM, against the default's 998
and 12) and for e5m2 on sm_80/86 (481 against 888 on sm_86); on sm_86 the 35 KB of shared
memory at 2 stages leaves 8 warps per SM (1 stage: 18.5 KB, 20 warps, a tuned setting), and
e5m2 on sm_90 counts more than the default (768 against 674). ``decode_t_unfit`` names why
it cannot run and the caller uses the other kernel. With bf16 activations the MMAs still take
fp16 (decoded codes are exact there; q's fp16 path and P times V's scale as in
``paged_attention``'s kernel for bf16 models).
"""

import functools
import logging
import os

import torch
from qpage.kernels.fp8_codec import (
    E4M3_PTX,
    E5M2_PTX,
    _capability,
    encode_fp8_ref,
    f32_to_fp8,
    fp8_decoder,
    fp8_to_f16,
    fp8_unit,
)

from qpage.kernels.triton_utils import INTERPRET, tl, triton

logger = logging.getLogger("qpage")

E4M3_WORD_PTX = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; "
    "mov.b32 {lo, hi}, $4; "
    "cvt.rn.f16x2.e4m3x2 a, lo; "  # codes 0, 1 -> (low half, high half)
    "cvt.rn.f16x2.e4m3x2 b, hi; "
    "mov.b32 {$0, $1}, a; "
    "mov.b32 {$2, $3}, b; }"
)
"""One 32-bit word of four e4m3 codes (code i in byte i) -> four fp16 values, code i in ``$i``
(the hardware conversion, sm_89+)."""


def _word_asm(pairs_ptx: str) -> str:
    """``fp8_codec``'s four-codes-to-two-fp16-pairs PTX (``$2`` in, ``$0``/``$1`` out) as one word
    in (``$4``) and four fp16 out (``$0``-``$3``, code i in ``$i``), like ``E4M3_WORD_PTX``."""
    body = pairs_ptx.replace("$2", "$4").replace("$0", "w0").replace("$1", "w1")
    return "{ .reg .b32 w0, w1; " + body + " mov.b32 {$0, $1}, w0; mov.b32 {$2, $3}, w1; }"


E4M3_BITS_WORD_PTX = tl.constexpr(_word_asm(E4M3_PTX.value))
"""Four e4m3 codes -> four fp16 equal to value / 2**8 by bit arithmetic (sm_80/86)."""
E5M2_WORD_PTX = tl.constexpr(_word_asm(E5M2_PTX.value))
"""Four e5m2 codes -> four fp16 (each code is its fp16's high byte)."""

P_SHIFT = 256.0
"""P^T's rows times V's per-token scale are multiplied by this before the fp16 cast (and the
output divided by it) in fp16 models: with V scales up to 65504 / 448 there, products stay
under fp16's maximum, and small probabilities stay clear of its subnormals."""


def p_shift(dtype: torch.dtype) -> float:
    """``P_SHIFT`` for fp16 models. A bf16 model's V values, and so its scales (stored in fp16,
    up to 65504), may be larger: P (at most 1) times the scale alone always fits fp16, as in
    ``paged_attention``'s kernel, which casts the same product to fp16 for bf16 models. The
    interpreter multiplies in fp32 and needs none."""
    return P_SHIFT if dtype == torch.float16 and not INTERPRET else 1.0


@triton.jit
def _v_words(vc_ptr, blk, offs_n, n_mask, head, stride_cb, stride_ct, stride_ch,
             HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr, IS_E5M2: tl.constexpr,
             CVT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """V rows of positions ``offs_n`` decoded, [BLOCK_N, DIM_PAD] in DOT_DTYPE (value / unit, as
    ``fp8_codec.fp8_to_f16`` decodes under ``CVT``), loaded as 32-bit words of four codes."""
    offs_w = tl.arange(0, DIM_PAD // 4)
    row = (blk * stride_cb + (offs_n % PAGE) * stride_ct + head * stride_ch) // 4
    mask = n_mask[:, None] & (offs_w < HEAD_DIM // 4)[None, :]
    w = tl.load(vc_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] + offs_w[None, :], mask=mask, other=0)
    if CVT == 2:  # CVT_HW (e4m3)
        v0, v1, v2, v3 = tl.inline_asm_elementwise(E4M3_WORD_PTX, "=h,=h,=h,=h,r", [w], is_pure=True, pack=1,
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16))
    elif CVT == 1 and IS_E5M2:  # CVT_PTX
        v0, v1, v2, v3 = tl.inline_asm_elementwise(E5M2_WORD_PTX, "=h,=h,=h,=h,r", [w], is_pure=True, pack=1,
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16))
    elif CVT == 1:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(E4M3_BITS_WORD_PTX, "=h,=h,=h,=h,r", [w], is_pure=True, pack=1,
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16))
    else:  # CVT_BITS: the interpreter
        v0 = fp8_to_f16((w & 0xFF).to(tl.uint8), IS_E5M2, 0)
        v1 = fp8_to_f16(((w >> 8) & 0xFF).to(tl.uint8), IS_E5M2, 0)
        v2 = fp8_to_f16(((w >> 16) & 0xFF).to(tl.uint8), IS_E5M2, 0)
        v3 = fp8_to_f16(((w >> 24) & 0xFF).to(tl.uint8), IS_E5M2, 0)
    v = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BLOCK_N, words, 2, 2]: code 2i + j at [.., i, j]
    return tl.reshape(v, (offs_n.shape[0], DIM_PAD)).to(DOT_DTYPE)


@triton.jit
def _e4m3_per_head(x):
    """(unit, e4m3 codes) of x [DIM_PAD, Q_PAD] fp32: each head's largest |x| maps to 448."""
    unit = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 448.0
    return unit, f32_to_fp8(x / unit[None, :], False).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _decode_t_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
    qk_scale, v_unit, partition,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt,
    stride_ob, stride_oh, stride_op,
    KV_HEADS: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_TOKEN: tl.constexpr, QK_FP8: tl.constexpr, IS_E5M2: tl.constexpr, CVT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SHIFT: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    offs_q = tl.arange(0, Q_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    q_mask = offs_q < QPK
    d_mask = offs_d < HEAD_DIM
    heads = h * QPK + offs_q
    # P^T's rows carry V's per-token scale times SHIFT; the decoder's unit and 1 / SHIFT go to the output.
    if PER_TOKEN:
        v_out = v_unit / SHIFT
    else:  # per-tensor scales fold into q and the output
        qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32)
        v_out = tl.load(vs_ptr).to(tl.float32) * v_unit / SHIFT
    # q^T [DIM_PAD, Q_PAD], scaled so that scores come out in log2 units.
    qt = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
                 mask=q_mask[None, :] & d_mask[:, None], other=0.0).to(tl.float32) * qk_scale
    if QK_FP8:  # q ~ hi * u_hi + lo * u_lo, both e4m3 per head (quantize_queries_ref)
        q_unit, q_hi = _e4m3_per_head(qt)
        lo_unit, q_lo = _e4m3_per_head(qt - q_hi.to(tl.float32) * q_unit[None, :])
    else:
        q_unit = tl.full((Q_PAD,), 1.0, dtype=tl.float32)
        q_hi = qt.to(DOT_DTYPE)
    m_i = tl.full((Q_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_PAD,), dtype=tl.float32)
    acc = tl.zeros((DIM_PAD, Q_PAD), dtype=tl.float32)  # O^T
    start = part * partition
    end = start + partition
    if end > seq_len:
        end = seq_len
    bt = bt_ptr + b * stride_bt
    for n0 in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):  # None: num_stages (K alone)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(bt + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(kc_ptr + (blk * stride_cb + (offs_n % PAGE) * stride_ct + h * stride_ch)[:, None]
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0)
        if QK_FP8:
            k8 = k.to(tl.float8e4nv, bitcast=True)
            st = tl.dot(k8, q_hi) * q_unit[None, :] + tl.dot(k8, q_lo) * lo_unit[None, :]
        else:  # decoded value / 2**8 under the interpreter's bit trick: the 2**8 is in qk_scale
            st = tl.dot(fp8_to_f16(k, IS_E5M2, CVT).to(DOT_DTYPE), q_hi, input_precision=PRECISION)
        v = _v_words(vc_ptr, blk, offs_n, n_mask, h, stride_cb, stride_ct, stride_ch, HEAD_DIM, DIM_PAD, PAGE,
                     IS_E5M2, CVT, DOT_DTYPE)
        if PER_TOKEN:  # 32-bit offsets: paged_attention.check_scale_offsets
            sidx = (blk.to(tl.int32) * PAGE + offs_n % PAGE) * KV_HEADS + h
            k_mul = tl.load(ks_ptr + sidx, mask=n_mask, other=0.0).to(tl.float32)
            v_mul = tl.load(vs_ptr + sidx, mask=n_mask, other=0.0).to(tl.float32) * SHIFT
            st = st * k_mul[:, None]
        st = tl.where(n_mask[:, None], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        p = tl.exp2(st - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if PER_TOKEN:
            p = p * v_mul[:, None]
        elif SHIFT != 1.0:
            p = p * SHIFT
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    acc = acc * v_out
    out_mask = d_mask[:, None] & q_mask[None, :]
    if SPLIT:
        base = b * stride_ob + heads * stride_oh + part * stride_op
        tl.store(out_ptr + (base * DIM_PAD)[None, :] + offs_d[:, None], acc, mask=out_mask)
        tl.store(m_ptr + base, m_i, mask=q_mask)
        tl.store(l_ptr + base, l_i, mask=q_mask)
    else:
        out = acc / l_i[None, :]
        tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + offs_d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


def default_qk_fp8() -> bool:
    """Whether q K^T runs in FP8 by default (tuned tables aside): with Triton 3.8+, which issues
    it as FP8 wgmma with 8 query columns. Triton 3.6-3.7 take wgmma only from 16 columns on
    sm_90 (8 fall back to mma.sync with the FP8 operands converted to fp16); there, by count,
    fp16 q K^T with 8 columns (mma.sync) is level with the FP8 wgmma with 16 (30.5 against
    29.6 warp instructions per token, 16 resident warps per SM each) and keeps q exact
    (``kernel_sass.py --attention`` with each Triton, docs/kernels.md)."""
    return _triton_version() >= (3, 8)


@functools.lru_cache(maxsize=1)
def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def decode_t_unfit(q: torch.Tensor, k_cache: torch.Tensor, fp8_format: str | None) -> str | None:
    """Why ``_decode_t_kernel`` cannot serve this call (None: it can)."""
    if fp8_format not in ("e4m3", "e5m2"):
        return "the cache is not FP8: the tokens-as-rows decode reads FP8 codes"
    if q.shape[-1] % 4 or any(s % 4 for s in k_cache.stride()[:3]) or k_cache.data_ptr() % 4:
        return "V is read in 4-byte words: head_dim, the cache strides and its start must be multiples of 4"
    if q.shape[-1] < 32:
        return f"head_dim {q.shape[-1]}: FP8 MMAs reduce over at least 32"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{q.dtype} queries"
    if INTERPRET:
        return None
    if q.device.type != "cuda" or _capability(q.device) < (8, 0):
        return "it needs a CUDA GPU of compute capability 8.0+"
    if q.dtype == torch.float32:
        return "fp32 activations (its MMAs are fp16 and FP8)"
    return None


def qk_fp8_unfit(q: torch.Tensor, fp8_format: str | None) -> str | None:
    """Why q K^T cannot run in FP8 here (None: it can): e4m3 codes and FP8 MMAs (sm_89+)."""
    if fp8_format != "e4m3":
        return f"q K^T in FP8 takes e4m3 codes, not {fp8_format}"
    if not INTERPRET and (q.device.type != "cuda" or _capability(q.device) < (8, 9)):
        return "q K^T in FP8 needs FP8 MMAs (compute capability 8.9+)"
    return None


def launch_decode_t(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, dst: torch.Tensor,
                    m: torch.Tensor, lsum: torch.Tensor, out_strides: tuple[int, int, int], qk_scale: float,
                    partition: int, parts: int, block_n: int, qk_fp8: bool, num_warps: int | None,
                    num_stages: int, fp8_format: str = "e4m3", q_pad: int | None = None,
                    loop_stages: int | None = None, maxnreg: int | None = None) -> None:
    """One launch over (sequence, kv head, partition) into ``paged_attention_decode``'s buffers.
    ``qk_scale`` is softmax scale * log2(e); ``q_pad`` the MMA's query columns (default 8). The
    codes are decoded as ``fp8_codec.fp8_decoder`` chooses for this device (hardware e4m3 on
    sm_89+, packed PTX on sm_80/86 and for e5m2, the bit trick under the interpreter).
    ``loop_stages`` pipelines every load of the loop (``tl.range``; the V words, scales and
    block ids too: with ``num_stages`` alone only K's codes, which feed the dot, go by async
    copy); None leaves that to ``num_stages``. ``maxnreg`` caps registers per thread; None is
    ``default_maxnreg``, 0 no cap."""
    bsz, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qpk = heads // kvh
    per_token = k_scale.dim() == 3
    cvt = fp8_decoder(q.device, fp8_format)
    unit = fp8_unit(fp8_format, cvt)  # what the decoder leaves out of each code
    if not qk_fp8:
        qk_scale *= unit  # K's decoded codes: the unit goes to the scores through q
    dot_dtype = tl.float32 if INTERPRET else tl.float16
    warps = num_warps or 4
    q_cols = max(q_pad or 8, triton.next_power_of_2(qpk))
    if maxnreg is None:
        gpu = not INTERPRET and q.device.type == "cuda"
        maxnreg = default_maxnreg(_capability(q.device) if gpu else None, warps, block_n, q_cols)
    _decode_t_kernel[(bsz, kvh, parts)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, dst, m, lsum,
        qk_scale, unit, partition,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *out_strides,
        KV_HEADS=kvh, QPK=qpk, Q_PAD=q_cols, HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim), PAGE=k_cache.shape[1], SPLIT=parts > 1, BLOCK_N=block_n,
        PER_TOKEN=per_token, QK_FP8=qk_fp8, IS_E5M2=fp8_format == "e5m2", CVT=cvt, DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if INTERPRET else "tf32", SHIFT=p_shift(q.dtype), LOOP_STAGES=loop_stages,
        num_warps=warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
    )


def default_maxnreg(capability: tuple[int, int] | None, num_warps: int, block_n: int, q_cols: int) -> int | None:
    """The register cap of the kernel above on a GPU of ``capability`` (None: not a GPU), from
    the static counts (``kernel_sass.py --attention``; no spills at either cap). On sm_90 at 4
    warps and 64-token tiles: 80 with 8 query columns, which fits 6 programs (24 warps) per SM
    where 83-106 registers (Triton 3.9 / 3.6) fit 5 or 4, at -0.5% / +5.5% loop instructions;
    96 with 16 columns, whose shared memory allows 5 programs (3.6: 474 -> 500 instructions, 4
    -> 5 programs; at 80, 529). None elsewhere: 128-token tiles' shared memory allows 3 programs
    anyway (there a cap of 80 cost +33%), and on sm_80-89 shared memory is the limit at 64 tokens
    too (sm_80: 4 programs, sm_86/89: 2 at 2 stages)."""
    if capability != (9, 0) or num_warps != 4 or block_n != 64:
        return None
    return 80 if q_cols <= 8 else 96


def _e4m3_per_head_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, unit) of x [..., D]: the largest |x| of each head maps to 448."""
    unit = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return encode_fp8_ref(x / unit, "e4m3").view(torch.float8_e4m3fn).float(), unit


def quantize_queries_ref(q: torch.Tensor, qk_scale: float = 1.0, split: bool = True) -> torch.Tensor:
    """q [..., H, D] as ``_decode_t_kernel`` multiplies it with ``QK_FP8``, in q's units (fp32):
    x = q * qk_scale rounded to e4m3 per head, plus (``split``) the rounding's residual rounded
    to e4m3 per head likewise, x ~ hi * u_hi + lo * u_lo."""
    x = q.float() * qk_scale
    hi, u_hi = _e4m3_per_head_ref(x)
    approx = hi * u_hi
    if split:
        lo, u_lo = _e4m3_per_head_ref(x - approx)
        approx = approx + lo * u_lo
    return approx / qk_scale


def use_decode_t(q: torch.Tensor, k_cache: torch.Tensor, fp8_format: str | None, tuned: dict,
                 decode_t: bool | None) -> bool:
    """Whether this decode call runs ``_decode_t_kernel``. Asked for explicitly (``decode_t=True``)
    where it cannot run: ValueError naming why. Asked for by the tuned table or
    ``QPAGE_DECODE_T=1``: the reason is logged once and the other kernel runs."""
    explicit = decode_t is not None
    if decode_t is None:
        decode_t = bool(tuned.get("decode_t", False)) or os.environ.get("QPAGE_DECODE_T", "") == "1"
    if not decode_t:
        return False
    why = decode_t_unfit(q, k_cache, fp8_format)
    if why is None and not INTERPRET and not decode_t_ok(q.device, q.dtype, fp8_format or "e4m3"):
        why = "it failed its first-use check on this GPU (see the warning logged)"
    if why is None:
        return True
    if explicit:
        raise ValueError(f"decode_t=True: {why}; leave decode_t unset to use the default decode kernel")
    _log_once(why)
    return False


@functools.lru_cache(maxsize=8)
def _log_once(reason: str) -> None:
    logger.info("tokens-as-rows FP8 decode not used: %s", reason)


_CHECKED: dict[tuple[str, str, str], bool] = {}


def decode_t_ok(device: torch.device, dtype: torch.dtype = torch.float16, fp8_format: str = "e4m3") -> bool:
    """Whether the kernel (its inline PTX, its FP8 MMAs) matches the torch reference on
    ``device`` with ``dtype`` queries and ``fp8_format`` codes, with and without ``QK_FP8``
    where it can run: checked once per process, device, dtype and format at the first use
    outside a CUDA graph capture, on two sequences with per-token and per-tensor scales. A
    mismatch logs a warning and the default decode kernel serves instead."""
    key = (str(device), str(dtype), fp8_format)
    if key not in _CHECKED:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True  # no launch or sync inside a capture; the check runs at the next use
        _CHECKED[key] = True  # the check's own launches
        try:
            fp8_qk = (True, False) if qk_fp8_unfit(torch.empty(0, device=device), fp8_format) is None else (False,)
            errors = [_check_error(device, pt, qk8, dtype, fp8_format) for pt in (True, False) for qk8 in fp8_qk]
            found = ", ".join(f"{e:.2e}" for e in errors)
        except Exception as e:  # e.g. this Triton cannot compile it
            errors, found = [float("inf")], f"{type(e).__name__}: {e}"
        _CHECKED[key] = max(errors) < CHECK_TOLERANCE
        if not _CHECKED[key]:
            logger.warning("tokens-as-rows FP8 decode failed its check on %s with %s queries (relative errors "
                           "against the reference, tolerance %g: %s); using the default decode kernel. Please "
                           "report this with the GPU, driver and Triton versions.", device, dtype, CHECK_TOLERANCE,
                           found)
    return _CHECKED[key]


CHECK_TOLERANCE = 1e-2
"""fp16 MMAs and an fp16 or bf16 output: ~1e-3 (bf16: ~4e-3) from the reference when right;
a wrong code order or scale lands far above."""


def _check_error(device: torch.device, per_token: bool, qk_fp8: bool, dtype: torch.dtype, fmt: str) -> float:
    """Relative error of the kernel against the reference on a small random cache (CPU-built)."""
    from qpage.kernels.cache_write import write_kv_cache_ref
    from qpage.kernels.paged_attention import LOG2E, paged_attention_decode, paged_attention_decode_ref

    g = torch.Generator().manual_seed(0)
    kvh, heads, dim, page, lens = 2, 8, 128, 16, [100, 37]
    kc = torch.zeros(16, page, kvh, dim, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    if per_token:
        ks, vs = torch.zeros(16, page, kvh, dtype=torch.float16), torch.zeros(16, page, kvh, dtype=torch.float16)
    else:
        ks, vs = torch.tensor([0.03]), torch.tensor([0.02])
    table = torch.randperm(16, generator=g)[:14].reshape(2, 7).to(torch.int32)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[i].long()[pos // page] * page + pos % page
        write_kv_cache_ref(torch.randn(n, kvh, dim, generator=g), torch.randn(n, kvh, dim, generator=g),
                           kc, vc, slots, ks, vs, fmt)
    q = torch.randn(2, heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    seq = torch.tensor(lens, dtype=torch.int32)
    on = [t.to(device) for t in (q, kc, vc, table, seq, ks, vs)]
    got = paged_attention_decode(on[0], on[1], on[2], on[3], on[4], scale, k_scale=on[5], v_scale=on[6],
                                 fp8_format=fmt, decode_t=True, qk_fp8=qk_fp8).float().cpu()
    q_ref = quantize_queries_ref(q, scale * LOG2E) if qk_fp8 else q.float()
    want = paged_attention_decode_ref(q_ref, kc, vc, table, seq, scale, k_scale=ks, v_scale=vs, fp8_format=fmt)
    return float((got - want).norm() / want.norm())
