"""Paged attention over the KV cache (fp16/bf16/fp32 or FP8 codes), decode and prefill.

Cache layout and FP8 scale modes: see ``cache_write``. ``block_tables`` int32
[seqs, max_blocks] maps a sequence's logical block to a physical one.

- **Decode** (``paged_attention_decode``): one query token per sequence, q [B, H, D].
  A program owns (sequence, kv head, partition of ``partition`` tokens) and all H / kv_heads
  query heads of that kv head (GQA: each K/V byte is read once, padded to 16 query rows for
  ``tl.dot``). With several partitions (flash-decoding) a second kernel merges the partial
  softmaxes; long contexts thus fill the GPU even at batch 1.
- **Prefill** (``paged_prefill.paged_attention_prefill``): chunks of new tokens, q [T, H, D] flattened
  with ``cu_seqlens_q``, whose K/V are already in the cache; the chunk of sequence s ends
  at context position ``context_lens[s]``, so query i attends causally to cache positions
  ``<= context_lens[s] - q_len + i``: earlier chunks (chunked prefill, prefix-cache hits)
  and the new tokens alike.

FP8 codes are decoded in registers (``fp8_codec``) and multiplied by their scale; scores
and the softmax are fp32 (exp2 with log2(e) folded into the query scale).
"""

import math

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.fp8_codec import decode_fp8_ref, fp8_decoder, fp8_to_f16, fp8_unit, sm90_plus
from qpage.kernels.paged_decode_t import default_qk_fp8, launch_decode_t, qk_fp8_unfit, use_decode_t
from qpage.kernels.triton_utils import INTERPRET, tl, triton
from qpage.kernels.tuned import decode_settings

LOG2E = 1.4426950408889634


@triton.jit
def _blocks(bt_ptr, offs_n, n_mask, PAGE: tl.constexpr):
    """Physical block (int64) of each position ``offs_n`` of one sequence: read once per tile
    and shared by the K, V and scale loads."""
    return tl.load(bt_ptr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)


@triton.jit
def _to_dot(raw, FP8: tl.constexpr, IS_E5M2: tl.constexpr, FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A loaded tile in the dot dtype. FP8 codes become value / (scale * unit): the caller
    applies the scale per token to the scores (K), and to the probabilities or, with V staged
    as fp16, to V's rows (``_scale_v_rows``)."""
    if FP8:
        return fp8_to_f16(raw, IS_E5M2, FP8_CVT).to(DOT_DTYPE)
    else:
        return raw.to(DOT_DTYPE)


@triton.jit
def _load_raw(c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch, PAGE: tl.constexpr):
    """K or V rows of positions ``offs_n`` (in blocks ``blk``) as stored, [BLOCK_N, DIM_PAD]."""
    offs = (blk * stride_cb + (offs_n % PAGE) * stride_ct + head * stride_ch)[:, None] + offs_d[None, :]
    return tl.load(c_ptr + offs, mask=n_mask[:, None] & d_mask[None, :], other=0)


@triton.jit
def _load_kv_tile(
    c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch,
    PAGE: tl.constexpr, FP8: tl.constexpr, IS_E5M2: tl.constexpr, FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """K or V rows of positions ``offs_n`` (in blocks ``blk``), [BLOCK_N, DIM_PAD] in DOT_DTYPE."""
    raw = _load_raw(c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch, PAGE)
    return _to_dot(raw, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)


@triton.jit
def _token_scale(s_ptr, blk, offs_n, n_mask, head, unit,
                 KV_HEADS: tl.constexpr, PAGE: tl.constexpr, PER_TOKEN: tl.constexpr):
    """[BLOCK_N] fp32 multiplier of each position's decoded row (1 where there is none).

    The offset is 32-bit (``check_scale_offsets``): a scale tensor holds 2 bytes per cached
    K or V row, so it stays under 2**31 elements long after the cache outgrows 32-bit byte
    offsets, and 64-bit address arithmetic cost the sm_90 decode loop 27 instructions per
    tile (672 -> 645, per-token, 4 warps; 8 warps: 413 -> 403 in 80 registers)."""
    if PER_TOKEN:
        s = tl.load(s_ptr + (blk.to(tl.int32) * PAGE + offs_n % PAGE) * KV_HEADS + head, mask=n_mask, other=0.0)
        return s.to(tl.float32) * unit
    else:
        return tl.full(offs_n.shape, 1.0, dtype=tl.float32)


@triton.jit
def _tile_scales(ks_ptr, vs_ptr, bt, n0, end, head, unit,
                 KV_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-token K and V multipliers of the tile starting at ``n0`` (with its own block ids)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    mask = offs < end
    blk = _blocks(bt, offs, mask, PAGE)
    return (_token_scale(ks_ptr, blk, offs, mask, head, unit, KV_HEADS, PAGE, True),
            _token_scale(vs_ptr, blk, offs, mask, head, unit, KV_HEADS, PAGE, True))


@triton.jit
def _scale_v_rows(v, vs_ptr, blk, offs_n, n_mask, head, unit, KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                  PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Decoded V rows times their per-token scale (or 1, and 0 past the end, for a per-tensor scale).

    A per-row factor stops Triton from loading V's codes in the MMA operand layout and
    converting them there, which gathers each operand register byte by byte (P @ V reduces
    over tokens while the codes run along d): V is converted row by row instead and staged
    as fp16 for ``ldmatrix.trans``. Multiplying is how the per-token scale gets applied
    anyway; a select did the same for the layout at about two instructions more per code
    (split, select and re-pack each fp16 pair). The factor (an fp16 scale times a power of
    two) is exact in fp16 and the product rounds once, in packed halves. ``PER_TOKEN`` False
    (per-tensor scales, or a bf16 model whose values need not fit fp16): rows of 1 and 0,
    the scale applied elsewhere in fp32."""
    if PER_TOKEN:
        rows = _token_scale(vs_ptr, blk, offs_n, n_mask, head, unit, KV_HEADS, PAGE, PER_TOKEN)
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
    FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
    SCALES_AHEAD: tl.constexpr, V_F16: tl.constexpr,
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
    if PREFETCH:  # register double-buffering: tile i+1's loads are issued before tile i's math
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = _blocks(bt, offs_n, n_mask, PAGE)
        k_raw = _load_raw(kc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch, PAGE)
        v_raw = _load_raw(vc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch, PAGE)
    if PER_TOKEN and SCALES_AHEAD:
        k_mul, v_mul_n = _tile_scales(ks_ptr, vs_ptr, bt, start, end, h, unit, KV_HEADS, PAGE, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PER_TOKEN and SCALES_AHEAD:  # the next tile's scales, consumed one iteration later
            k_mul_next, v_mul_next = _tile_scales(ks_ptr, vs_ptr, bt, n0 + BLOCK_N, end, h, unit, KV_HEADS, PAGE,
                                                  BLOCK_N)
        if PREFETCH:
            nxt = offs_n + BLOCK_N
            nxt_mask = nxt < end
            nxt_blk = _blocks(bt, nxt, nxt_mask, PAGE)
            k_next = _load_raw(kc_ptr, nxt_blk, nxt, nxt_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                               PAGE)
            v_next = _load_raw(vc_ptr, nxt_blk, nxt, nxt_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                               PAGE)
            k = _to_dot(k_raw, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
            v = _to_dot(v_raw, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
        else:
            blk = _blocks(bt, offs_n, n_mask, PAGE)
            k = _load_kv_tile(kc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                              PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
            v = _load_kv_tile(vc_ptr, blk, offs_n, n_mask, offs_d, d_mask, h, stride_cb, stride_ct, stride_ch,
                              PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
        if FP8 and V_F16:
            v = _scale_v_rows(v, vs_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN and ROW_SCALES,
                              DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if PER_TOKEN and SCALES_AHEAD:
            s = s * k_mul[None, :]
        elif PER_TOKEN:
            s = s * _token_scale(ks_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
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
            pv_in = p * _token_scale(vs_ptr, blk, offs_n, n_mask, h, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
        else:
            pv_in = p
        pv = tl.dot(pv_in.to(DOT_DTYPE), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if PREFETCH:
            k_raw, v_raw, blk = k_next, v_next, nxt_blk
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


def _launch_args(q: torch.Tensor, k_scale: torch.Tensor | None, fp8_format: str | None, scale: float,
                 scaled_rows: bool = False) -> tuple[list, dict]:
    """(qk_scale, unit) and the FP8 constexprs shared by the decode and prefill launches.

    The dot dtype is the activations' (fp32 under the interpreter), except that FP8 codes
    under bf16 activations are multiplied in fp16: the decoded codes (value / unit, at most
    448) are exact in fp16, which keeps 3 more mantissa bits than bf16 and saves converting
    every code fp16 -> fp32 -> bf16 (sm_90 per-token decode loop: 972 -> 651 instructions). Not
    where per-token scales multiply the K/V rows in the dot dtype (``scaled_rows``): a bf16
    model's cache values need not fit fp16's range."""
    fp8 = fp8_format is not None
    per_token = fp8 and k_scale is not None and k_scale.dim() == 3
    if per_token:
        check_scale_offsets(k_scale)
    cvt = fp8_decoder(q.device, fp8_format) if fp8 else 0
    unit = fp8_unit(fp8_format, cvt) if fp8 else 1.0
    if INTERPRET or q.dtype == torch.float32:
        dot_dtype = tl.float32
    elif q.dtype == torch.bfloat16 and (not fp8 or (per_token and scaled_rows)):
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = tl.float16
    return [scale * LOG2E, unit], dict(FP8=fp8, IS_E5M2=fp8_format == "e5m2", PER_TOKEN=per_token, FP8_CVT=cvt,
                                       DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")


def check_scale_offsets(k_scale: torch.Tensor | None) -> None:
    """Per-token scale tensors are indexed with 32-bit offsets in the kernels (``_token_scale``)."""
    if k_scale is not None and k_scale.numel() >= 2**31:
        raise ValueError(f"per-token KV scales hold {k_scale.numel()} elements, over the kernels' 32-bit offsets "
                         f"(2**31): use fewer KV cache blocks per layer (--kv-cache-memory / "
                         f"gpu_memory_utilization) or a per-tensor FP8 scale")


def v_f16_default(device: torch.device) -> bool:
    """Stage FP8 V as fp16 unless tuned otherwise: on sm_90 (static count, benchmarks/NOTES-kernels.md)
    it cuts the loop's instructions and registers (per-token, 4 warps: 177 -> 140, so 3 programs
    per SM instead of 2); on sm_80-89, with 100 KB of shared memory per SM, its extra 16 KB
    staging buffer costs more occupancy than the registers save."""
    return sm90_plus(device)


def decode_kernel_choice(q: torch.Tensor, k_cache: torch.Tensor, fp8_format: str | None, tuned: dict | None = None,
                         decode_t: bool | None = None, qk_fp8: bool | None = None,
                         per_token: bool = True) -> tuple[bool, bool]:
    """(whether ``paged_attention_decode`` runs ``paged_decode_t``'s kernel, whether that one
    rounds q to two e4m3 parts) for these arguments; ``tuned`` defaults to this GPU's table."""
    if tuned is None:
        tuned = decode_settings(q.device, fp8_format, per_token, q.shape[-1], q.shape[1] // k_cache.shape[2])
    if not use_decode_t(q, k_cache, fp8_format, tuned, decode_t):
        return False, False
    why = qk_fp8_unfit(q, fp8_format)
    if qk_fp8 and why:
        raise ValueError(f"qk_fp8=True: {why}; leave qk_fp8 unset")
    if qk_fp8 is None:
        qk_fp8 = bool(tuned.get("qk_fp8", default_qk_fp8())) and why is None
    return True, qk_fp8


def paged_attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, fp8_format: str | None = None, partition: int | None = None,
    max_seq_len: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, prefetch: bool | None = None, scales_ahead: bool | None = None,
    v_f16: bool | None = None, maxnreg: int | None = None, decode_t: bool | None = None,
    qk_fp8: bool | None = None, q_pad: int | None = None, loop_stages: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]. ``partition`` (tokens, a multiple of ``block_n``) enables
    split-KV; None picks one from ``max_seq_len`` (defaults to the longest of ``seq_lens``).
    Settings left None come from this GPU's tuned table (``tuned``), else the defaults.
    ``prefetch`` issues the next tile's loads before the current tile's math (register
    double-buffering, for FP8 tiles that cannot go through Triton's async-copy pipeline).
    ``scales_ahead`` (default on) loads a tile's per-token scales, and the block ids they need,
    one iteration early: Triton pipelines the K/V codes by async copy but not these loads,
    which otherwise leave two dependent global-memory latencies exposed per tile. ``v_f16``
    converts FP8 V row by row and stages it as fp16 for the P @ V product (see the kernel;
    default ``v_f16_default``), multiplying each row by its per-token scale on the way.
    ``maxnreg`` caps registers per thread (ptxas), for one more resident program per SM: on
    sm_90, 8 warps with FP8 V staged hold 86 registers (2 programs per SM); capped at 80, 3
    fit, with no spills (``kernel_sass.py --attention``). Only the tuner's timing can say
    whether the occupancy is worth the extra instructions, so it is a tuned setting.
    ``decode_t`` runs ``paged_decode_t``'s kernel instead (tokens as the MMA's rows; FP8
    caches, fp16 or bf16 models, sm_80+; default: the tuned table, else ``QPAGE_DECODE_T=1``),
    with ``qk_fp8`` computing q K^T in FP8 with q split into two e4m3 parts (e4m3, sm_89+;
    default: the tuned table, else ``paged_decode_t.default_qk_fp8``), ``q_pad`` query
    columns (8 or 16) and ``loop_stages`` (all of its loads pipelined; see ``launch_decode_t``,
    which also caps its registers on sm_90 unless ``maxnreg`` says otherwise, 0: no cap).

    ``partition`` is a runtime argument, not a compile-time one: decode's max_seq_len grows
    every step, and a constexpr would compile a new kernel each time."""
    bsz, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qpk = heads // kvh
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    scalars, flags = _launch_args(q, k_scale, fp8_format, scale)
    tuned = decode_settings(q.device, fp8_format, flags["PER_TOKEN"], dim, qpk)
    block_n = block_n or tuned.get("block_n") or (32 if INTERPRET else 64)
    num_warps = num_warps or tuned.get("num_warps")
    num_stages = num_stages or tuned.get("num_stages") or 2
    prefetch = bool(tuned.get("prefetch", False)) if prefetch is None else prefetch
    scales_ahead = bool(tuned.get("scales_ahead", True)) if scales_ahead is None else scales_ahead
    v_f16 = bool(tuned.get("v_f16", v_f16_default(q.device))) if v_f16 is None else v_f16
    cap = maxnreg or tuned.get("maxnreg")  # the default kernel's: none unless asked (0 or None)
    reg_cap = {"maxnreg": cap} if cap else {}
    if partition is None:
        split_from = tuned.get("partition", 512)
        if max_seq_len > 2 * split_from and not INTERPRET:
            partition = split_from
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
    use_t, qk_fp8 = decode_kernel_choice(q, k_cache, fp8_format, tuned, decode_t, qk_fp8)
    if use_t:
        launch_decode_t(q, k_cache, v_cache, ks, vs, block_tables, seq_lens, dst, m, lsum, strides, scalars[0],
                        partition, parts, block_n, qk_fp8, num_warps, num_stages, fp8_format,
                        q_pad or tuned.get("q_pad"), loop_stages or tuned.get("loop_stages"),
                        maxnreg if maxnreg is not None else tuned.get("maxnreg"))
    else:
        _decode_kernel[(bsz, kvh, parts)](
            q, k_cache, v_cache, ks, vs, block_tables, seq_lens, dst, m, lsum,
            *scalars, partition,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            *strides,
            KV_HEADS=kvh, QPK=qpk, Q_PAD=max(16, triton.next_power_of_2(qpk)),
            HEAD_DIM=dim, DIM_PAD=dim_pad, PAGE=BLOCK_SIZE, SPLIT=split, BLOCK_N=block_n, PREFETCH=prefetch,
            SCALES_AHEAD=scales_ahead, V_F16=v_f16, **flags,
            num_warps=num_warps, num_stages=num_stages, **reg_cap,
        )
    if split:
        _decode_reduce_kernel[(bsz, heads)](
            acc, m, lsum, out, parts, out.stride(0), out.stride(1),
            HEAD_DIM=dim, DIM_PAD=dim_pad, PARTS_PAD=triton.next_power_of_2(parts), num_warps=4,
        )
    return out


# ------------------------------------------------------------------------- references


def dequantize_cache_ref(
    cache: torch.Tensor, scale: torch.Tensor | None, fp8_format: str | None,
) -> torch.Tensor:
    """The fp32 values a cache holds, [num_blocks, BLOCK_SIZE, kv_heads, head_dim]."""
    if fp8_format is None:
        return cache.float()
    x = decode_fp8_ref(cache, fp8_format)
    assert scale is not None
    return x * (scale.float()[..., None] if scale.dim() == 3 else scale.float())


def _attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal_offset: int
                ) -> torch.Tensor:
    """q [n, H, D], keys/values [L, KVH, D] fp32; query i sees keys <= causal_offset + i."""
    heads, kvh = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(heads // kvh, 1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(heads // kvh, 1).transpose(0, 1)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    idx = torch.arange(keys.shape[0])
    allowed = idx[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v)


def _context_ref(kf: torch.Tensor, vf: torch.Tensor, table: torch.Tensor, length: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = table[: math.ceil(length / BLOCK_SIZE)].long().cpu()
    kvh, dim = kf.shape[2], kf.shape[3]
    return kf[ids].reshape(-1, kvh, dim)[:length], vf[ids].reshape(-1, kvh, dim)[:length]


def paged_attention_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
) -> torch.Tensor:
    kf = dequantize_cache_ref(k_cache, k_scale, fp8_format).cpu()
    vf = dequantize_cache_ref(v_cache, v_scale, fp8_format).cpu()
    outs = []
    for b, length in enumerate(seq_lens.tolist()):
        keys, values = _context_ref(kf, vf, block_tables[b], length)
        outs.append(_attend_ref(q[b : b + 1].cpu(), keys, values, scale, length - 1))
    return torch.cat(outs).to(q.dtype).to(q.device)
