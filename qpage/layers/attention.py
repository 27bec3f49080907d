"""Attention over the paged KV cache.

Cache layout, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]``; token slot ``s`` lives at block
``s // BLOCK_SIZE``, offset ``s % BLOCK_SIZE``. A step's batch is flattened: the requests
that compute one token (decodes) come first, then the prefill chunks, each a contiguous
range of tokens.

The torch path below is the CPU implementation and the reference. The seam for GPU
kernels is ``AttentionBackend``: a Triton backend implements the same two methods over
the same metadata and is picked by ``select_backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from qpage.config import BLOCK_SIZE


@dataclass(slots=True)
class PrefillSeq:
    start: int
    """First row of this chunk in the flattened batch."""
    end: int
    """One past its last row."""
    context_len: int
    """Tokens in its KV after this step (cached context plus this chunk)."""
    block_ids: torch.Tensor
    """Its block table, long [ceil(context_len / BLOCK_SIZE)]."""
    mask: torch.Tensor | None
    """Bool [chunk, context_len], True = attend; None when the chunk has no earlier context."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """Long [num_tokens]: cache slot of each new token's K and V."""
    num_decodes: int = 0
    """Rows [0, num_decodes) are single-token queries, one per request."""
    decode_block_table: torch.Tensor | None = None
    """Long [num_decodes, max_blocks], padded with block 0 (masked out)."""
    decode_mask: torch.Tensor | None = None
    """Bool [num_decodes, 1, 1, max_blocks * BLOCK_SIZE]: True for positions < seq_len."""
    prefills: list[PrefillSeq] = field(default_factory=list)


class AttentionBackend(Protocol):
    def write_cache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Paged attention in plain torch (SDPA over K/V gathered block by block)."""

    name = "torch"

    def write_cache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kvh, hd = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's, already written). Returns [T, H, D]."""
        outs = []
        nd = meta.num_decodes
        if nd:
            outs.append(self._decode(q[:nd], k_cache, v_cache, meta, scale))
        for p in meta.prefills:
            outs.append(self._prefill(q, k, v, k_cache, v_cache, p, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    @staticmethod
    def _decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        bt = meta.decode_block_table
        assert bt is not None and meta.decode_mask is not None
        n, kvh, hd = bt.shape[0], k_cache.shape[2], k_cache.shape[3]
        # [n, blocks, BLOCK, kvh, hd] -> [n, kvh, blocks*BLOCK, hd]
        keys = k_cache[bt].view(n, -1, kvh, hd).transpose(1, 2)
        values = v_cache[bt].view(n, -1, kvh, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, p: PrefillSeq, scale: float,
    ) -> torch.Tensor:
        qs = q[p.start : p.end].transpose(0, 1)
        if p.mask is None:
            # Whole context is this chunk: attend to the fresh K/V, causal.
            keys = k[p.start : p.end].transpose(0, 1)
            values = v[p.start : p.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                qs, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kvh, hd = k_cache.shape[2], k_cache.shape[3]
            keys = k_cache[p.block_ids].view(-1, kvh, hd)[: p.context_len].transpose(0, 1)
            values = v_cache[p.block_ids].view(-1, kvh, hd)[: p.context_len].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                qs, keys, values, attn_mask=p.mask, scale=scale, enable_gqa=True
            )
        return out.transpose(0, 1)


def select_backend(device: torch.device) -> AttentionBackend:
    """The attention implementation for a device. Triton kernels plug in here."""
    return TorchPagedAttention()


def make_kv_cache(
    num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
