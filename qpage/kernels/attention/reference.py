"""Plain-torch references of the paged attention kernels (what the tests compare against)."""

import math

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.fp8.codec import decode_fp8_ref


def dequantize_cache_ref(
    cache: torch.Tensor, scale: torch.Tensor | None, fp8_format: str | None,
) -> torch.Tensor:
    """The fp32 values a cache holds, [num_blocks, BLOCK_SIZE, kv_heads, head_dim]."""
    if fp8_format is None:
        return cache.float()
    x = decode_fp8_ref(cache, fp8_format)
    assert scale is not None
    return x * (scale.float()[..., None] if scale.dim() == 3 else scale.float())


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal_offset: int
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


def context_ref(kf: torch.Tensor, vf: torch.Tensor, table: torch.Tensor, length: int
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
        keys, values = context_ref(kf, vf, block_tables[b], length)
        outs.append(attend_ref(q[b : b + 1].cpu(), keys, values, scale, length - 1))
    return torch.cat(outs).to(q.dtype).to(q.device)


def paged_attention_prefill_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
) -> torch.Tensor:
    kf = dequantize_cache_ref(k_cache, k_scale, fp8_format).cpu()
    vf = dequantize_cache_ref(v_cache, v_scale, fp8_format).cpu()
    cu = cu_seqlens_q.tolist()
    outs = []
    for s, length in enumerate(context_lens.tolist()):
        qs = q[cu[s] : cu[s + 1]].cpu()
        keys, values = context_ref(kf, vf, block_tables[s], length)
        outs.append(attend_ref(qs, keys, values, scale, length - qs.shape[0]))
    return torch.cat(outs).to(q.dtype).to(q.device)
