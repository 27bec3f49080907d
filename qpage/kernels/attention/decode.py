"""Paged decode attention: one query token per sequence over its paged K/V (the model dtype
or FP8 codes).

q [B, H, D]. A program owns (sequence, kv head, partition of ``partition`` tokens) and all
H / kv_heads query heads of that kv head (GQA: each K/V byte is read once, the query rows
padded to 16 for ``tl.dot``). With several partitions (flash-decoding) a second kernel merges
the partial softmaxes, so long contexts fill the GPU even at batch 1. FP8 codes are decoded
in registers (``fp8.codec``) and multiplied by their scale; scores and the softmax are fp32
(exp2 with log2(e) folded into the query scale). Layouts and shared helpers: ``tiles``.
"""

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.attention.tiles import blocks, launch_args, load_kv_tile, token_scale
from qpage.kernels.configs import DecodeConfig, default_decode_config
from qpage.kernels.triton_utils import INTERPRET, tl, triton
from qpage.kernels.tuned import tuned_decode_config


@triton.jit
def _tile_scales(ks_ptr, vs_ptr, bt, n0, end, head, unit,
                 KV_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-token K and V multipliers of the tile starting at ``n0`` (with its own block ids)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    mask = offs < end
    blk = blocks(bt, offs, mask, PAGE)
    return (token_scale(ks_ptr, blk, offs, mask, head, unit, KV_HEADS, PAGE, True),
            token_scale(vs_ptr, blk, offs, mask, head, unit, KV_HEADS, PAGE, True))


@triton.jit
def _scale_v_rows(v, vs_ptr, blk, offs_n, n_mask, head, unit, KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                  PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Decoded V rows times their per-token scale (or 1, and 0 past the end, for a per-tensor scale).

    A per-row factor stops Triton from loading V's codes in the MMA operand layout and
    converting them there, which gathers each operand register byte by byte (P @ V reduces
    over tokens while the codes run along d): V is converted row by row instead and staged
    as fp16 for ``ldmatrix.trans``. Multiplying is how the per-token scale gets applied
    anyway; a select would do the same for the layout at more instructions per code (split,
    select and re-pack each fp16 pair). The factor (an fp16 scale times a power of
    two) is exact in fp16 and the product rounds once, in packed halves. ``PER_TOKEN`` False
    (per-tensor scales, or a bf16 model whose values need not fit fp16): rows of 1 and 0,
    the scale applied elsewhere in fp32."""
    if PER_TOKEN:
        rows = token_scale(vs_ptr, blk, offs_n, n_mask, head, unit, KV_HEADS, PAGE, PER_TOKEN)
    else:
        rows = tl.where(n_mask, 1.0, 0.0)
    return v * rows.to(DOT_DTYPE)[:, None]


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
    qk_scale, unit, partition,
    stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt,
    stride_ob, stride_oh, stride_op,
    KV_HEADS: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, IS_E5M2: tl.constexpr, PER_TOKEN: tl.constexpr,
    FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SCALES_AHEAD: tl.constexpr,
    V_F16: tl.constexpr,
):
    # Per-token scales may multiply fp16 V rows unless the model is bf16 (its values need not fit fp16).
    ROW_SCALES: tl.constexpr = q_ptr.dtype.element_ty != tl.bfloat16
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    offs_q = tl.arange(0, Q_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    q_mask = offs_q < QPK
    d_mask = offs_d < HEAD_DIM
    heads = h * QPK + offs_q
    # qk_scale = softmax scale * log2(e): scores come out in log2 units.
    if FP8 and not PER_TOKEN:  # a per-tensor scale folds into q and the output
        qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32) * unit
        v_mul = tl.load(vs_ptr).to(tl.float32) * unit
    else:
        v_mul = 1.0
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask[:, None] & d_mask[None, :], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
    m_i = tl.full((Q_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((Q_PAD,), dtype=tl.float32)
    acc = tl.zeros((Q_PAD, DIM_PAD), dtype=tl.float32)
    start = part * partition
    end = start + partition
    if end > seq_len:
        end = seq_len
    bt = bt_ptr + b * stride_bt
    if PER_TOKEN and SCALES_AHEAD:
        k_mul, v_mul_n = _tile_scales(ks_ptr, vs_ptr, bt, start, end, h, unit, KV_HEADS, PAGE, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PER_TOKEN and SCALES_AHEAD:  # the next tile's scales, consumed one iteration later
            k_mul_next, v_mul_next = _tile_scales(ks_ptr, vs_ptr, bt, n0 + BLOCK_N, end, h, unit, KV_HEADS, PAGE,
                                                  BLOCK_N)
        blk = blocks(bt, offs_n, n_mask, PAGE)
        k = load_kv_tile(kc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                         PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
        v = load_kv_tile(vc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                         PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
        if FP8 and V_F16:
            v = _scale_v_rows(v, vs_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN and ROW_SCALES,
                              DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if PER_TOKEN and SCALES_AHEAD:
            s = s * k_mul[None, :]
        elif PER_TOKEN:
            s = s * token_scale(ks_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PER_TOKEN and V_F16 and ROW_SCALES:  # V's scales are in its rows
            pv_in = p
        elif PER_TOKEN and SCALES_AHEAD:
            pv_in = p * v_mul_n[None, :]
        elif PER_TOKEN:
            pv_in = p * token_scale(vs_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
        else:
            pv_in = p
        pv = tl.dot(pv_in.to(DOT_DTYPE), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if PER_TOKEN and SCALES_AHEAD:
            k_mul, v_mul_n = k_mul_next, v_mul_next
    acc = acc * v_mul
    out_mask = q_mask[:, None] & d_mask[None, :]
    if SPLIT:
        base = b * stride_ob + heads * stride_oh + part * stride_op
        tl.store(out_ptr + (base * DIM_PAD)[:, None] + offs_d[None, :], acc, mask=out_mask)
        tl.store(m_ptr + base, m_i, mask=q_mask)
        tl.store(l_ptr + base, l_i, mask=q_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, num_parts,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """Merge the partitions of one (sequence, head): out = sum_p w_p acc_p / sum_p w_p l_p."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    p_mask = offs_p < num_parts
    base = (b * heads + h) * num_parts + offs_p
    m = tl.load(m_ptr + base, mask=p_mask, other=float("-inf"))
    l_p = tl.load(l_ptr + base, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(p_mask & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    acc = tl.load(acc_ptr + (base * DIM_PAD)[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_p * w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def decode_config(q: torch.Tensor, k_cache: torch.Tensor, fp8_format: str | None, per_token: bool) -> DecodeConfig:
    """This GPU's tuned settings for the cache mode, laid over the device's defaults."""
    return tuned_decode_config(q.device, fp8_format, per_token, q.shape[-1], q.shape[1] // k_cache.shape[2],
                               default_decode_config(q.device))


def paged_attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, fp8_format: str | None = None, max_seq_len: int | None = None,
    config: DecodeConfig | None = None, partition: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D] over the sequences' cached K/V (``seq_lens`` include this
    step's token). ``config`` defaults to ``decode_config``; ``max_seq_len`` to the longest of
    ``seq_lens``. Contexts longer than two of the config's partitions are split (not under the
    interpreter); ``partition`` (tokens, a multiple of ``block_n``) forces a split width.

    The partition width is a runtime argument, not a compile-time one: decode's max_seq_len
    grows every step, and a constexpr would compile a new kernel each time."""
    bsz, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qpk = heads // kvh
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    scalars, flags = launch_args(q, k_scale, fp8_format, scale)
    cfg = config or decode_config(q, k_cache, fp8_format, flags["PER_TOKEN"])
    block_n = cfg.block_n
    if partition is None:
        if max_seq_len > 2 * cfg.partition and not INTERPRET:
            partition = cfg.partition
        else:  # one partition: the whole sequence, rounded up to whole tiles
            partition = triton.cdiv(max(max_seq_len, 1), block_n) * block_n
    if partition % block_n:
        raise ValueError(f"partition ({partition}) must be a multiple of block_n ({block_n})")
    parts = triton.cdiv(max_seq_len, partition)
    dim_pad = triton.next_power_of_2(dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = parts > 1
    if split:
        acc = torch.empty((bsz, heads, parts, dim_pad), dtype=torch.float32, device=q.device)
        m = torch.empty((bsz, heads, parts), dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        dst, strides = acc, (heads * parts, parts, 1)
    else:
        dst, m, lsum = out, out, out
        strides = (out.stride(0), out.stride(1), 0)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    _decode_kernel[(bsz, kvh, parts)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, dst, m, lsum,
        *scalars, partition,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *strides,
        KV_HEADS=kvh, QPK=qpk, Q_PAD=max(16, triton.next_power_of_2(qpk)),
        HEAD_DIM=dim, DIM_PAD=dim_pad, PAGE=BLOCK_SIZE, SPLIT=split, BLOCK_N=block_n,
        SCALES_AHEAD=cfg.scales_ahead, V_F16=cfg.v_f16, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        _decode_reduce_kernel[(bsz, heads)](
            acc, m, lsum, out, parts, out.stride(0), out.stride(1),
            HEAD_DIM=dim, DIM_PAD=dim_pad, PARTS_PAD=triton.next_power_of_2(parts), num_warps=4,
        )
    return out
