"""The Triton attention backend: cache write and paged attention kernels (``kernels.attention``).

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (tests). Its metadata, built once per
step from the runner's batch: int32 block tables and lengths in the kernels' layout, a table
per group of decodes of similar length (``metadata.decode_groups``: each group's
longest context decides its split-KV partitions) and one for all the prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qpage.kernels.attention.cache_write import write_kv_cache
from qpage.kernels.attention.decode import paged_attention_decode
from qpage.kernels.attention.int_cache import dequantize_blocks, paged_decode_int, write_int_cache
from qpage.kernels.attention.prefill import paged_attention_prefill
from qpage.layers.attention.kv_format import Fp8KV, IntKV, KVCacheSpec, LayerKV
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan, decode_groups


@dataclass
class TritonDecode:
    start: int
    """First row of the group in the batch."""
    end: int
    """One past its last row."""
    block_tables: torch.Tensor
    """int32 [rows, max_blocks], padded with 0."""
    seq_lens: torch.Tensor
    """int32 [rows], this step's token included."""
    max_seq_len: int


@dataclass
class TritonPrefill:
    start: int
    """First row of the chunks in the batch (they run to its end)."""
    block_tables: torch.Tensor
    """int32 [chunks, max_blocks]."""
    cu_seqlens_q: torch.Tensor
    """int32 [chunks + 1]: row offsets of the chunks, from 0."""
    context_lens: torch.Tensor
    """int32 [chunks]."""
    max_q_len: int


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor
    decodes: list[TritonDecode]
    prefill: TritonPrefill | None


def _tables(spans: list[SeqSpan], device: torch.device) -> torch.Tensor:
    width = max(len(s.block_ids) for s in spans)
    table = torch.zeros(len(spans), width, dtype=torch.int32)
    for i, s in enumerate(spans):
        table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
    return table.to(device)


class TritonPagedAttention:
    """The write and attend kernels are bound to the cache format once, here."""

    name = "triton"

    def __init__(self, spec: KVCacheSpec) -> None:
        if spec.kv_bits is not None:
            self.write_cache, self.attend = _write_int, _attend_int  # type: ignore[method-assign]
        elif spec.fp8_format is not None:
            self.write_cache, self.attend = _write_fp8, _attend_fp8  # type: ignore[method-assign]

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TritonMetadata:
        decodes, prefill = [], None
        for a, b in decode_groups(batch.decodes):
            spans = batch.decodes[a:b]
            lens = [s.context_len for s in spans]
            decodes.append(TritonDecode(spans[0].start, spans[-1].end, _tables(spans, device),
                                        torch.tensor(lens, dtype=torch.int32, device=device), max(lens)))
        if batch.prefills:
            ps = batch.prefills
            cu = [0]
            for s in ps:
                cu.append(cu[-1] + s.end - s.start)
            prefill = TritonPrefill(ps[0].start, _tables(ps, device),
                                    torch.tensor(cu, dtype=torch.int32, device=device),
                                    torch.tensor([s.context_len for s in ps], dtype=torch.int32, device=device),
                                    max(s.end - s.start for s in ps))
        return TritonMetadata(batch.slot_mapping, decodes, prefill)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        write_kv_cache(k, v, cache.k, cache.v, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: TritonMetadata,
               scale: float, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert window is None and softcap is None and sinks is None, (
            "the selector gives windows, soft caps and sinks to backends declaring them")
        return _attend(q, cache, meta, scale)


def _attend(q: torch.Tensor, cache: LayerKV | Fp8KV, meta: TritonMetadata, scale: float,
            **kw: torch.Tensor | str) -> torch.Tensor:
    """A cache in the model dtype, or FP8 codes (``kw``: their scales and format)."""
    outs = []
    for d in meta.decodes:
        outs.append(paged_attention_decode(q[d.start : d.end], cache.k, cache.v, d.block_tables, d.seq_lens,
                                           scale, max_seq_len=d.max_seq_len, **kw))  # type: ignore[arg-type]
    if (p := meta.prefill) is not None:
        outs.append(paged_attention_prefill(q[p.start :], cache.k, cache.v, p.block_tables, p.cu_seqlens_q,
                                            p.context_lens, p.max_q_len, scale, **kw))  # type: ignore[arg-type]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _write_fp8(k: torch.Tensor, v: torch.Tensor, cache: Fp8KV, slot_mapping: torch.Tensor) -> None:
    write_kv_cache(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale, cache.fp8_format)


def _attend_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Fp8KV, meta: TritonMetadata,
                scale: float, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _attend(q, cache, meta, scale, k_scale=cache.k_scale, v_scale=cache.v_scale, fp8_format=cache.fp8_format)


def _write_int(k: torch.Tensor, v: torch.Tensor, cache: IntKV, slot_mapping: torch.Tensor) -> None:
    write_int_cache(k, cache.k, cache.k_scale, slot_mapping, cache.k_bits)
    write_int_cache(v, cache.v, cache.v_scale, slot_mapping, cache.v_bits)


def _attend_int(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: IntKV, meta: TritonMetadata,
                scale: float, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """An integer cache: decode reads the codes in place; prefill dequantizes the blocks its
    chunks use, each once, and runs the model-dtype prefill kernel on them."""
    kb, vb = cache.k_bits, cache.v_bits
    outs = []
    for d in meta.decodes:
        outs.append(paged_decode_int(q[d.start : d.end], cache.k, cache.v, cache.k_scale, cache.v_scale, kb, vb,
                                     d.block_tables, d.seq_lens, scale))
    if (p := meta.prefill) is not None:
        # Each block once (tables repeat shared prefixes and pad with block 0).
        ids, tables = torch.unique(p.block_tables, return_inverse=True)
        ids = ids.to(torch.int32)
        keys = dequantize_blocks(cache.k, cache.k_scale, kb, ids, cache.head_dim, q.dtype)
        values = dequantize_blocks(cache.v, cache.v_scale, vb, ids, cache.head_dim, q.dtype)
        tables = tables.to(torch.int32)
        outs.append(paged_attention_prefill(q[p.start :], keys, values, tables, p.cu_seqlens_q, p.context_lens,
                                            p.max_q_len, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
