"""The Triton attention backend: cache write and paged attention kernels (``qpage.kernels``).

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (tests). Per step it converts the
block tables and lengths of the metadata to the kernels' int32 layout once (kept in the
metadata's scratch) and reuses them in every layer.
"""

from __future__ import annotations

import torch

from qpage.kernels.cache_write import write_kv_cache
from qpage.kernels.paged_attention import paged_attention_decode
from qpage.kernels.paged_prefill import paged_attention_prefill
from qpage.layers.attention import AttentionMetadata
from qpage.layers.kv_format import LayerKV


class TritonPagedAttention:
    name = "triton"

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        write_kv_cache(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale, cache.fp8_format)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        prep = meta.scratch.get("triton")
        if prep is None:
            prep = meta.scratch["triton"] = _prepare(meta, q.device)
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, fp8_format=cache.fp8_format)
        outs = []
        for d, (table, lens) in zip(meta.decode_groups, prep["decode"], strict=True):  # type: ignore[call-overload]
            outs.append(paged_attention_decode(q[d.start : d.end], cache.k, cache.v, table, lens, scale,
                                               max_seq_len=d.max_seq_len, **kw))
        if meta.prefills:
            start, end = meta.prefills[0].start, meta.prefills[-1].end
            tables, cu, ctx, max_q = prep["prefill"]  # type: ignore[misc]
            outs.append(paged_attention_prefill(q[start:end], cache.k, cache.v, tables, cu, ctx, max_q, scale, **kw))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _prepare(meta: AttentionMetadata, device: torch.device) -> dict[str, object]:
    decode = []
    for d in meta.decode_groups:
        assert d.seq_lens is not None, "the model runner fills DecodeGroup.seq_lens"
        decode.append((d.block_table.to(device=device, dtype=torch.int32),
                       d.seq_lens.to(device=device, dtype=torch.int32)))
    prefill = None
    if meta.prefills:
        width = max(p.block_ids.shape[0] for p in meta.prefills)
        tables = torch.zeros(len(meta.prefills), width, dtype=torch.int32)
        cu = [0]
        for i, p in enumerate(meta.prefills):
            tables[i, : p.block_ids.shape[0]] = p.block_ids
            cu.append(cu[-1] + p.end - p.start)
        ctx = torch.tensor([p.context_len for p in meta.prefills], dtype=torch.int32, device=device)
        max_q = max(p.end - p.start for p in meta.prefills)
        prefill = (tables.to(device), torch.tensor(cu, dtype=torch.int32, device=device), ctx, max_q)
    return {"decode": decode, "prefill": prefill}
