"""Attention over the paged KV cache.

Cache layout per layer: ``kv_format.LayerKV`` (model dtype, or FP8 or integer codes with
scales). The batch layout and the metadata: ``metadata``.

The torch paths below are the CPU implementation and the reference; with a quantized cache
they dequantize what they gather. ``AttentionBackend`` is the seam: the Triton backend
(``triton_backend``) implements the same methods with its own metadata, and
``selector.select_attention_backend`` picks one by declared capabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from qpage.kernels.cpu.attention import blas_attention, native_fp8, native_fp32, native_int
from qpage.layers.attention.kv_format import Fp8KV, IntKV, KVCacheSpec, LayerKV, gather_kv
from qpage.layers.attention.metadata import (
    AttentionBatch,
    AttentionMetadata,
    DecodeGroup,
    PrefillSeq,
    build_torch_metadata,
    mask_bias,
)


class AttentionBackend(Protocol):
    name: str

    def __init__(self, spec: KVCacheSpec) -> None:
        """Bind the write and read functions for the cache format ``spec`` (once)."""
        ...

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> Any:
        """This backend's metadata for the step (once per step; every layer reuses it). It
        carries the batch's ``slot_mapping``."""
        ...

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: Any,
               scale: float, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's, already written) -> [T, H, D].
        ``window``: each row attends to its last ``window`` positions only; ``softcap``: scores
        pass through ``softcap * tanh(s / softcap)``; ``sinks`` [H]: one more logit per head in
        the softmax's denominator, attending to nothing (gpt-oss). Only backends that declare
        these features are given them (``selector.FEATURES``)."""
        ...


class TorchPagedAttention:
    """Paged attention in plain torch (SDPA over K/V gathered block by block); every cache
    kind writes and reads itself (``LayerKV.write_ref``, ``read_blocks``)."""

    name = "torch"

    def __init__(self, spec: KVCacheSpec) -> None:
        self.read_back = spec.format is not None
        """A quantized cache: attention reads this step's K/V back from it too (see ``attend``)."""

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
        return build_torch_metadata(batch, device)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        cache.write_ref(k, v, slot_mapping)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: AttentionMetadata,
        scale: float, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's, already written). Returns [T, H, D].

        With a quantized cache every key and value is read back from the cache, this step's
        included, so all paths (and the Triton kernels) attend to the same quantized K/V.
        """
        if window is not None or softcap is not None or sinks is not None:
            return masked_attention(q, cache, meta, scale, window, softcap, sinks)
        outs = [self._decode(q[d.start : d.end], cache, d, scale) for d in meta.decode_groups]
        for p in meta.prefills:
            if self.read_back and p.mask is None:
                outs.append(self._prefill_from_cache(q, cache, p, scale))
            else:
                outs.append(self._prefill(q, k, v, cache, p, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _prefill_from_cache(self, q: torch.Tensor, cache: LayerKV, p: PrefillSeq, scale: float) -> torch.Tensor:
        """A chunk with no earlier context, its K/V read back from the (quantized) cache."""
        keys, values = self._gather(cache, p.block_ids[None], p.context_len)
        return self._prefill(q, keys[0], values[0], cache, PrefillSeq(0, p.end - p.start, p.context_len,
                                                                      p.block_ids, None), scale, q_offset=p.start)

    @staticmethod
    def _decode(q: torch.Tensor, cache: LayerKV, d: DecodeGroup, scale: float) -> torch.Tensor:
        keys, values = gather_kv(cache, d.block_table)  # [n, L, kvh, hd]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=d.mask, scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _gather(cache: LayerKV, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a prefill's context (``gather_kv``); a backend may read the cache its own way."""
        return gather_kv(cache, block_table, length)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, p: PrefillSeq, scale: float,
        q_offset: int = 0,
    ) -> torch.Tensor:
        """``k``/``v`` rows p.start:p.end are the chunk's own K/V (used when it has no context);
        q rows are offset by ``q_offset`` (the chunk's place in the batch, when k/v are not)."""
        qs = q[q_offset + p.start : q_offset + p.end].transpose(0, 1)
        if p.mask is None:
            # Whole context is this chunk: attend to the fresh K/V, causal.
            keys = k[p.start : p.end].transpose(0, 1)
            values = v[p.start : p.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                qs, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            keys, values = self._gather(cache, p.block_ids[None], p.context_len)
            out = F.scaled_dot_product_attention(
                qs, keys[0].transpose(0, 1), values[0].transpose(0, 1), attn_mask=p.mask, scale=scale,
                enable_gqa=True,
            )
        return out.transpose(0, 1)


class CpuBlasPagedAttention(TorchPagedAttention):
    """fp32 on CPU: the same gathers, with the matmuls on NumPy's BLAS (``kernels.cpu.attention.blas_attention``)."""

    name = "cpu-blas"

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
        return build_torch_metadata(batch, device, bias=True)

    @staticmethod
    def _decode(q: torch.Tensor, cache: LayerKV, d: DecodeGroup, scale: float) -> torch.Tensor:
        bt = d.block_table
        if bt.shape[0] == 1:
            # One sequence, no padding: SDPA with the query heads grouped under their kv head
            # (no mask, no GQA expansion) beats the BLAS path at this size.
            if d.first_block is not None:
                kvh, hd = cache.k.shape[2], q.shape[-1]
                keys, values = cache.read_span(d.first_block, bt.shape[1])
                keys = keys.reshape(1, -1, kvh, hd)[:, : d.max_seq_len]
                values = values.reshape(1, -1, kvh, hd)[:, : d.max_seq_len]
            else:
                keys, values = gather_kv(cache, bt, d.max_seq_len)
            kvh, hd = keys.shape[2], keys.shape[3]
            out = F.scaled_dot_product_attention(
                q.view(1, kvh, -1, hd), keys.transpose(1, 2), values.transpose(1, 2), scale=scale
            )
            return out.view(q.shape)
        bias = d.bias if d.bias is not None else mask_bias(d.mask, bt.shape[0])
        keys, values = gather_kv(cache, bt)
        return blas_attention.decode_attention(q, keys, values, bias, scale)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, p: PrefillSeq, scale: float,
        q_offset: int = 0,
    ) -> torch.Tensor:
        if p.mask is None:
            keys, values = k[p.start : p.end], v[p.start : p.end]
        else:
            keys, values = self._gather(cache, p.block_ids[None], p.context_len)
            keys, values = keys[0], values[0]
        return blas_attention.prefill_attention(q[q_offset + p.start : q_offset + p.end], keys, values, scale)


class CpuNativePagedAttention(CpuBlasPagedAttention):
    """fp32 on CPU: attention and the cache write in C, reading and writing the cache blocks in
    place (``kernels.cpu.native`` for an fp32 cache, ``native_fp8`` for FP8 codes,
    ``native_int`` for int8/int4 codes). The functions are bound to the cache format once, here.

    Every row, a decode's or a prefill chunk's, goes through the one-query kernel over its own
    context (a prompt row at position p sees positions 0..p, read from the cache), so a row's
    result depends on its context alone: not on how its prompt was chunked, what else is in the
    batch, or whether its cache came from a prefix hit, a decode step or a recompute after
    preemption (docs/design.md, batch invariance)."""

    name = "cpu-native"

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__(spec)
        self._rows: Callable[..., torch.Tensor]
        """(q rows, cache, block table [rows or 1, blocks], context lengths, scale, window, soft cap,
        sinks) -> attention."""
        if spec.kv_bits is not None:
            self.write_cache = _write_int  # type: ignore[method-assign]
            self._rows = _rows_int
        elif spec.fp8_format is not None:
            self.write_cache = _write_fp8  # type: ignore[method-assign]
            self._rows = _rows_fp8
        else:
            self.write_cache = _write_plain  # type: ignore[method-assign]
            self._rows = _rows_plain

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
        return build_torch_metadata(batch, device)  # the C kernels read seq_lens, not a bias

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: AttentionMetadata,
        scale: float, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D] (this step's K/V are already in the cache). Returns [T, H, D]."""
        sinks = None if sinks is None else sinks.float().contiguous()
        outs = [self._rows(q[d.start : d.end], cache, d.block_table, _seq_lens(d), scale, window, softcap, sinks)
                for d in meta.decode_groups]
        for p in meta.prefills:
            assert p.row_lens is not None, "build_torch_metadata sets each prompt row's context length"
            outs.append(self._rows(q[p.start : p.end], cache, p.block_ids[None], p.row_lens, scale, window, softcap,
                                   sinks))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def masked_attention(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float, window: int | None,
                     softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a sliding window, soft-capped scores and/or sinks, every row over K/V read
    back from the cache (this step's included): a decode row at context length n sees positions
    [n - window, n), a prompt row at position p sees (p - window, p]."""
    outs = []
    for d in meta.decode_groups:
        keys, values = gather_kv(cache, d.block_table)  # [n, L, kvh, hd]
        lens = _seq_lens(d).to(q.device)
        pos = torch.arange(keys.shape[1], device=q.device)
        mask = pos[None, :] < lens[:, None]
        if window is not None:
            mask &= pos[None, :] >= (lens - window)[:, None]
        out = scaled_attention(q[d.start : d.end].unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                               mask[:, None, None, :], scale, softcap, sinks)
        outs.append(out.squeeze(2))
    for p in meta.prefills:
        n = p.end - p.start
        keys, values = gather_kv(cache, p.block_ids[None], p.context_len)  # [1, ctx, kvh, hd]
        qpos = torch.arange(p.context_len - n, p.context_len, device=q.device)[:, None]
        kpos = torch.arange(p.context_len, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        out = scaled_attention(q[p.start : p.end].transpose(0, 1)[None], keys.transpose(1, 2),
                               values.transpose(1, 2), mask[None, None], scale, softcap, sinks)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def scaled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Tq, D], keys/values [B, KVH, Tk, D], mask bool broadcasting to [B, H, Tq, Tk]
    (True: attend). Soft caps and sinks take the reference's eager path: scores, cap, mask, the
    sink as one more column of the softmax (then dropped), softmax in fp32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), values)
    sink = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), values)


def _seq_lens(d: DecodeGroup) -> torch.Tensor:
    return d.seq_lens if d.seq_lens is not None else d.mask.view(d.mask.shape[0], -1).sum(-1)


def _write_plain(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    native_fp32.write_kv(k, v, cache.k, cache.v, slot_mapping)


def _rows_plain(q: torch.Tensor, cache: LayerKV, table: torch.Tensor, lens: torch.Tensor, scale: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    return native_fp32.paged_decode(q, cache.k, cache.v, table, lens, scale, window, softcap, sinks)


def _write_fp8(k: torch.Tensor, v: torch.Tensor, cache: Fp8KV, slot_mapping: torch.Tensor) -> None:
    native_fp8.write_kv_fp8(k, v, cache.k, cache.v, slot_mapping, cache.k_scale, cache.v_scale, cache.fp8_format)


def _rows_fp8(q: torch.Tensor, cache: Fp8KV, table: torch.Tensor, lens: torch.Tensor, scale: float,
              window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    return native_fp8.paged_decode_fp8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, cache.fp8_format,
                                       table, lens, scale, window, softcap, sinks)


def _write_int(k: torch.Tensor, v: torch.Tensor, cache: IntKV, slot_mapping: torch.Tensor) -> None:
    native_int.write_int(k, cache.k, cache.k_scale, slot_mapping, cache.k_bits)
    native_int.write_int(v, cache.v, cache.v_scale, slot_mapping, cache.v_bits)


def _rows_int(q: torch.Tensor, cache: IntKV, table: torch.Tensor, lens: torch.Tensor, scale: float,
              window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    return native_int.paged_decode_int(q, cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_bits,
                                       cache.v_bits, table, lens, scale, window, softcap, sinks)
