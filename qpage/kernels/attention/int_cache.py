"""Triton kernels for the int8/int4 KV cache: the cache write, paged decode attention reading
the codes in place, and a block dequantizer that feeds prefill over the paged context.

Layout and rounding: ``kernels.kv_int`` (per (token, kv head): int8 codes with an fp16 scale,
or int4 codes two a byte, low nibble channel d and high nibble channel d + head_dim / 2, with
fp16 (scale, zero)). The write is bit-exact with ``kv_int.write_int_cache_ref``: IEEE
divides (``div_rn``), the scale rounded up to fp16, codes rounded half to even.

Decode: a program owns (sequence, kv head) and the kv head's query heads (GQA: each code is
read once). With k = c * s + z a score is s * (q . c) + z * sum(q), and the output is
sum_t (p_t s_t) c_t + sum_t p_t z_t, so the parameters apply per token, not per element; for
int4 the query and the output are split into the two nibble halves. Scores and the softmax
are fp32 (exp2, log2(e) folded into the query scale). No split-KV partitions: one program
walks the whole context.

Prefill reads its context through ``dequantize_blocks`` (the blocks a step's chunks use, in
the model dtype) and the model-dtype prefill kernel (``attention.prefill``).
"""

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.attention.tiles import LOG2E, blocks
from qpage.kernels.kv_int import MIN_SCALE, code_width
from qpage.kernels.triton_utils import tl, triton


@triton.jit
def _rint(x):
    """Round half to even (torch.round), for |x| well inside fp32's integers."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _half_at_least(s):
    """The smallest fp16 >= s (s > 0, fp32), as ``kv_int.half_at_least``."""
    h = s.to(tl.float16)
    up = (h.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < s, up, h)


@triton.jit
def _write_int8(x, c_ptr, p_ptr, slot, offs_h, offs_d, mask, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    amax = tl.max(tl.abs(x), axis=1)
    s = _half_at_least(tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), MIN_SCALE))
    sf = s.to(tl.float32)[:, None] + tl.zeros(x.shape, dtype=tl.float32)
    codes = tl.minimum(tl.maximum(_rint(tl.math.div_rn(x, sf)), -127.0), 127.0)
    tl.store(c_ptr + slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :],
             codes.to(tl.int8), mask=mask)
    tl.store(p_ptr + slot * KV_HEADS + offs_h, s, mask=offs_h < KV_HEADS)


@triton.jit
def _write_int4(lo_x, hi_x, c_ptr, p_ptr, slot, offs_h, offs_j, mask, KV_HEADS: tl.constexpr, HALF: tl.constexpr):
    lo = tl.minimum(tl.min(tl.where(mask, lo_x, float("inf")), axis=1),
                    tl.min(tl.where(mask, hi_x, float("inf")), axis=1))
    hi = tl.maximum(tl.max(tl.where(mask, lo_x, float("-inf")), axis=1),
                    tl.max(tl.where(mask, hi_x, float("-inf")), axis=1))
    h_mask = offs_h < KV_HEADS
    lo = tl.where(h_mask, lo, 0.0)
    hi = tl.where(h_mask, hi, 0.0)
    s = _half_at_least(tl.maximum(tl.math.div_rn(hi - lo, tl.full(lo.shape, 15.0, tl.float32)), MIN_SCALE))
    z = lo.to(tl.float16)
    sf = s.to(tl.float32)[:, None] + tl.zeros(lo_x.shape, dtype=tl.float32)
    zf = z.to(tl.float32)[:, None]
    c_lo = tl.minimum(tl.maximum(_rint(tl.math.div_rn(lo_x - zf, sf)), 0.0), 15.0).to(tl.int32)
    c_hi = tl.minimum(tl.maximum(_rint(tl.math.div_rn(hi_x - zf, sf)), 0.0), 15.0).to(tl.int32)
    tl.store(c_ptr + slot * (KV_HEADS * HALF) + offs_h[:, None] * HALF + offs_j[None, :],
             (c_lo | (c_hi << 4)).to(tl.uint8), mask=mask)
    base = (slot * KV_HEADS + offs_h) * 2
    tl.store(p_ptr + base, s, mask=h_mask)
    tl.store(p_ptr + base + 1, z, mask=h_mask)


@triton.jit
def _int_write_kernel(
    x_ptr, c_ptr, p_ptr, slot_ptr, stride_xt, stride_xh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr,
    BITS: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_w = tl.arange(0, WIDTH_PAD)
        at = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_w[None, :]
        if BITS == 8:
            mask = (offs_h < KV_HEADS)[:, None] & (offs_w < HEAD_DIM)[None, :]
            x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
            _write_int8(x, c_ptr, p_ptr, slot, offs_h, offs_w, mask, KV_HEADS, HEAD_DIM)
        else:
            HALF: tl.constexpr = HEAD_DIM // 2
            mask = (offs_h < KV_HEADS)[:, None] & (offs_w < HALF)[None, :]
            lo = tl.load(at, mask=mask, other=0.0).to(tl.float32)
            hi = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
            _write_int4(lo, hi, c_ptr, p_ptr, slot, offs_h, offs_w, mask, KV_HEADS, HALF)


def write_int_cache(x: torch.Tensor, cache: torch.Tensor, params: torch.Tensor, slot_mapping: torch.Tensor,
                    bits: int) -> None:
    """``kv_int.write_int_cache_ref`` for K or V: x [T, kvh, hd] (last dim contiguous), cache contiguous."""
    t, kvh, hd = x.shape
    if t == 0:
        return
    _int_write_kernel[(t,)](
        x, cache, params, slot_mapping, x.stride(0), x.stride(1), KV_HEADS=kvh, HEAD_DIM=hd,
        HEADS_PAD=triton.next_power_of_2(kvh), WIDTH_PAD=triton.next_power_of_2(code_width(bits, hd)), BITS=bits,
        num_warps=4,
    )


@triton.jit
def _load_codes(c_ptr, rows, n_mask, offs_w, WIDTH: tl.constexpr, BITS: tl.constexpr):
    """Codes of cache rows ``rows`` (slot * kv_heads + head) as fp32: int8 [BLOCK_N, WIDTH_PAD];
    int4 the low and high nibbles, each [BLOCK_N, WIDTH_PAD]."""
    mask = n_mask[:, None] & (offs_w < WIDTH)[None, :]
    raw = tl.load(c_ptr + rows[:, None] * WIDTH + offs_w[None, :], mask=mask, other=0)
    if BITS == 8:
        return raw.to(tl.float32), raw.to(tl.float32)
    b = raw.to(tl.int32)
    return (b & 15).to(tl.float32), (b >> 4).to(tl.float32)


@triton.jit
def _params(p_ptr, rows, n_mask, BITS: tl.constexpr):
    """Each row's fp32 (scale, zero); the zero is 0 for int8."""
    if BITS == 8:
        return tl.load(p_ptr + rows, mask=n_mask, other=0.0).to(tl.float32), tl.zeros(rows.shape, tl.float32)
    s = tl.load(p_ptr + rows * 2, mask=n_mask, other=0.0).to(tl.float32)
    return s, tl.load(p_ptr + rows * 2 + 1, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _int_decode_kernel(
    q_ptr, kc_ptr, vc_ptr, kp_ptr, vp_ptr, bt_ptr, lens_ptr, out_ptr, qk_scale,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr, K_WIDTH: tl.constexpr, K_PAD: tl.constexpr,
    V_BITS: tl.constexpr, V_WIDTH: tl.constexpr, V_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    offs_q = tl.arange(0, Q_PAD)
    offs_k = tl.arange(0, K_PAD)
    offs_v = tl.arange(0, V_PAD)
    heads = h * QPK + offs_q
    # int8: one part (lo) of WIDTH = head_dim; int4: the nibble halves, WIDTH = head_dim / 2 each.
    qk_mask = (offs_q < QPK)[:, None] & (offs_k < K_WIDTH)[None, :]
    at_q = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_k[None, :]
    q_lo = tl.load(at_q, mask=qk_mask, other=0.0).to(tl.float32) * qk_scale
    if K_BITS == 8:
        q_hi = tl.zeros((Q_PAD, K_PAD), dtype=tl.float32)
    else:
        q_hi = tl.load(at_q + K_WIDTH, mask=qk_mask, other=0.0).to(tl.float32) * qk_scale
    q_sum = tl.sum(q_lo, axis=1) + tl.sum(q_hi, axis=1)
    m_i = tl.full((Q_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_PAD,), dtype=tl.float32)
    acc_lo = tl.zeros((Q_PAD, V_PAD), dtype=tl.float32)
    acc_hi = tl.zeros((Q_PAD, V_PAD), dtype=tl.float32)
    acc_z = tl.zeros((Q_PAD,), dtype=tl.float32)
    bt = bt_ptr + b * stride_bt
    for n0 in range(0, seq_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        rows = (blocks(bt, offs_n, n_mask, PAGE) * PAGE + offs_n % PAGE) * KV_HEADS + h
        k_lo, k_hi = _load_codes(kc_ptr, rows, n_mask, offs_k, K_WIDTH, K_BITS)
        k_s, k_z = _params(kp_ptr, rows, n_mask, K_BITS)
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
        if K_BITS == 4:
            s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
        s = s * k_s[None, :] + q_sum[:, None] * k_z[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_lo, v_hi = _load_codes(vc_ptr, rows, n_mask, offs_v, V_WIDTH, V_BITS)
        v_s, v_z = _params(vp_ptr, rows, n_mask, V_BITS)
        ps = p * v_s[None, :]
        acc_lo = acc_lo * alpha[:, None] + tl.dot(ps, v_lo, input_precision="ieee")
        if V_BITS == 4:
            acc_hi = acc_hi * alpha[:, None] + tl.dot(ps, v_hi, input_precision="ieee")
        acc_z = acc_z * alpha + tl.sum(p * v_z[None, :], axis=1)
        m_i = m_new
    qv_mask = (offs_q < QPK)[:, None] & (offs_v < V_WIDTH)[None, :]
    at_o = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_v[None, :]
    tl.store(at_o, ((acc_lo + acc_z[:, None]) / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qv_mask)
    if V_BITS == 4:
        tl.store(at_o + V_WIDTH, ((acc_hi + acc_z[:, None]) / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=qv_mask)


def paged_decode_int(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_params: torch.Tensor,
                     v_params: torch.Tensor, k_bits: int, v_bits: int, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, block_n: int = 32) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D] over each sequence's cached codes (``seq_lens`` include this step's token)."""
    bsz, heads, dim = q.shape
    kvh = k_cache.shape[2]
    kw, vw = code_width(k_bits, dim), code_width(v_bits, dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _int_decode_kernel[(bsz, kvh)](
        q, k_cache, v_cache, k_params, v_params, block_tables, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        KV_HEADS=kvh, QPK=heads // kvh, Q_PAD=max(16, triton.next_power_of_2(heads // kvh)), PAGE=BLOCK_SIZE,
        BLOCK_N=block_n, K_BITS=k_bits, K_WIDTH=kw, K_PAD=max(16, triton.next_power_of_2(kw)),
        V_BITS=v_bits, V_WIDTH=vw, V_PAD=max(16, triton.next_power_of_2(vw)), num_warps=4,
    )
    return out


@triton.jit
def _dequant_blocks_kernel(
    c_ptr, p_ptr, ids_ptr, out_ptr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr,
    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BITS: tl.constexpr,
):
    """One block: its ROWS = BLOCK * kv_heads cache rows, dequantized."""
    i = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, ROWS_PAD)
    r_mask = offs_r < ROWS
    rows = tl.load(ids_ptr + i).to(tl.int64) * ROWS + offs_r
    offs_w = tl.arange(0, WIDTH_PAD)
    lo, hi = _load_codes(c_ptr, rows, r_mask, offs_w, WIDTH, BITS)
    s, z = _params(p_ptr, rows, r_mask, BITS)
    dst = out_ptr + (i * ROWS + offs_r)[:, None] * HEAD_DIM + offs_w[None, :]
    mask = r_mask[:, None] & (offs_w < WIDTH)[None, :]
    tl.store(dst, (lo * s[:, None] + z[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    if BITS == 4:
        tl.store(dst + WIDTH, (hi * s[:, None] + z[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_blocks(cache: torch.Tensor, params: torch.Tensor, bits: int, block_ids: torch.Tensor, head_dim: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """[len(block_ids), BLOCK, kvh, head_dim] in ``dtype``: whole blocks dequantized."""
    n, kvh = block_ids.numel(), cache.shape[2]
    width = code_width(bits, head_dim)
    out = torch.empty(n, BLOCK_SIZE, kvh, head_dim, dtype=dtype, device=cache.device)
    if n:
        _dequant_blocks_kernel[(n,)](
            cache, params, block_ids, out, HEAD_DIM=head_dim, WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width),
            ROWS=BLOCK_SIZE * kvh, ROWS_PAD=triton.next_power_of_2(BLOCK_SIZE * kvh), BITS=bits, num_warps=4,
        )
    return out
