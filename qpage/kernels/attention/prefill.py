"""Paged prefill / chunked-prefill attention: chunks of new tokens over their paged context.

Layouts, FP8 handling and the shared tile helpers: ``tiles``. q [T, H, D]
holds the chunks of several sequences, flattened (``cu_seqlens_q``); their K/V are already
in the cache. The chunk of sequence s ends at context position ``context_lens[s]``, so
query i attends causally to cache positions ``<= context_lens[s] - q_len + i``: earlier
chunks and prefix-cache hits alike. A program owns (sequence, query head, tile of BLOCK_M
query rows) and stops at the tile's causal limit.
"""

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.attention.tiles import blocks, launch_args, load_kv_tile, token_scale
from qpage.kernels.configs import sm90_plus
from qpage.kernels.triton_utils import INTERPRET, tl, triton


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr,
    qk_scale, unit,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
    KV_HEADS: tl.constexpr, QPK: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, IS_E5M2: tl.constexpr, PER_TOKEN: tl.constexpr, FP8_CVT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SCALE_ROWS: tl.constexpr,
):
    s_id = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_ptr + s_id)
    q_len = tl.load(cu_ptr + s_id + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx_len = tl.load(ctx_ptr + s_id)
        kvh = head // QPK
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, DIM_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        pos = ctx_len - q_len + offs_m  # absolute position of each query row
        if FP8 and not PER_TOKEN:  # a per-tensor scale folds into q and the output
            qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32) * unit
            v_mul = tl.load(vs_ptr).to(tl.float32) * unit
        else:
            v_mul = 1.0
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, DIM_PAD), dtype=tl.float32)
        end = ctx_len - q_len + tile * BLOCK_M + BLOCK_M
        if end > ctx_len:
            end = ctx_len
        bt = bt_ptr + s_id * stride_bt
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            blk = blocks(bt, offs_n, n_mask, PAGE)
            k = load_kv_tile(kc_ptr, blk, offs_n, n_mask, offs_d, d_mask, kvh, stride_cb, stride_ct, stride_ch,
                              PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
            v = load_kv_tile(vc_ptr, blk, offs_n, n_mask, offs_d, d_mask, kvh, stride_cb, stride_ct, stride_ch,
                              PAGE, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)
            if PER_TOKEN and SCALE_ROWS:  # see paged_attention_prefill
                k = (k * token_scale(ks_ptr, blk, offs_n, n_mask, kvh, unit, KV_HEADS, PAGE, PER_TOKEN
                                      ).to(DOT_DTYPE)[:, None]).to(DOT_DTYPE)
                v = (v * token_scale(vs_ptr, blk, offs_n, n_mask, kvh, unit, KV_HEADS, PAGE, PER_TOKEN
                                      ).to(DOT_DTYPE)[:, None]).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if PER_TOKEN and not SCALE_ROWS:
                s = s * token_scale(ks_ptr, blk, offs_n, n_mask, kvh, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
            allowed = (offs_n[None, :] <= pos[:, None]) & n_mask[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PER_TOKEN and not SCALE_ROWS:
                pv_in = p * token_scale(vs_ptr, blk, offs_n, n_mask, kvh, unit, KV_HEADS, PAGE, PER_TOKEN)[None, :]
            else:
                pv_in = p
            pv = tl.dot(pv_in.to(DOT_DTYPE), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc * v_mul / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_q_len: int, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
    scale_rows: bool | None = None,
) -> torch.Tensor:
    """q [T, H, D] (chunks of ``len(context_lens)`` sequences) -> out [T, H, D].

    ``scale_rows`` (per-token FP8 scales; default on sm_90+): multiply the decoded K and V rows
    by their tokens' scales, in the dot dtype, instead of the score and probability columns.
    With 64 query rows per program a thread holds many score columns but few K/V rows, so the
    scales (and the block ids they need) are loaded far fewer times, which cuts the loop's
    instructions and registers on sm_90; on sm_80-89 the kernel is register-bound either way.
    The product rounds once to fp16 (2**-11), well inside the FP8 code's own error."""
    heads, dim = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    nseq = context_lens.shape[0]
    block_m = 16 if INTERPRET else (64 if max_q_len > 32 else 16)
    block_n = 32 if INTERPRET else 64
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    grid = (nseq, heads, triton.cdiv(max_q_len, block_m))
    scale_rows = sm90_plus(q.device) if scale_rows is None else scale_rows
    scalars, flags = launch_args(q, k_scale, fp8_format, scale, scaled_rows=scale_rows)
    _prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, context_lens, out,
        *scalars,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        KV_HEADS=kvh, QPK=heads // kvh, HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim), PAGE=BLOCK_SIZE,
        BLOCK_M=block_m, BLOCK_N=block_n, SCALE_ROWS=scale_rows, **flags, num_warps=4, num_stages=2,
    )
    return out
