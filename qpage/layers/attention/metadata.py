"""A step's attention inputs: the runner's backend-neutral ``AttentionBatch``, and the metadata
the torch-family backends build from it once per step (``build_torch_metadata``).

A step's batch is flattened: the requests that compute one token (decodes) come first,
longest context first, then the prefill chunks, each a contiguous range of rows. Each
backend turns the batch into its own layout once per step (``AttentionBackend.build_metadata``)
and every layer reuses it: the torch paths want padded int64 block tables and masks per group
of similar lengths, the Triton kernels int32 tables of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from qpage.config import BLOCK_SIZE


@dataclass(slots=True)
class SeqSpan:
    """One request's rows in the step."""

    start: int
    """First row in the flattened batch."""
    end: int
    """One past its last row."""
    context_len: int
    """Tokens in its KV after this step (cached context plus this step's rows)."""
    block_ids: list[int]
    """Its block table (the KV manager's list: at least ceil(context_len / BLOCK_SIZE) ids)."""


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor
    """Long [num_tokens] on the model's device: cache slot of each new token's K and V."""
    decodes: list[SeqSpan] = field(default_factory=list)
    """One row each, longest context first."""
    prefills: list[SeqSpan] = field(default_factory=list)


class StepMetadata(Protocol):
    """What the model reads of any backend's metadata; the rest is the backend's own."""

    slot_mapping: torch.Tensor


@dataclass(slots=True)
class PrefillSeq:
    start: int
    """First row of this chunk in the flattened batch."""
    end: int
    """One past its last row."""
    context_len: int
    """Tokens in its KV after this step (cached context plus this chunk)."""
    block_ids: torch.Tensor
    """Its block table, long [>= ceil(context_len / BLOCK_SIZE)]."""
    mask: torch.Tensor | None
    """Bool [chunk, context_len], True = attend; None when the chunk has no earlier context."""
    row_lens: torch.Tensor | None = None
    """Long [chunk]: each row's context length, itself included (the C attention's seq_lens)."""


@dataclass(slots=True)
class DecodeGroup:
    """Single-token queries of similar context length, attended as one padded batch."""

    start: int
    """First row in the flattened batch."""
    end: int
    """One past the last row."""
    block_table: torch.Tensor
    """Long [rows, max_blocks], padded with block 0 (masked out)."""
    mask: torch.Tensor
    """Bool [rows, 1, 1, max_blocks * BLOCK_SIZE]: True for positions < seq_len."""
    max_seq_len: int
    """Context length of the group's longest (first) row, this step's token included."""
    seq_lens: torch.Tensor | None = None
    """Long [rows]: each row's context length, this step's token included."""
    first_block: int | None = None
    """For a one-row group whose blocks are consecutive ids, the first id (K/V can then be
    read as a view of the cache, without a gather); else None."""
    bias: torch.Tensor | None = None
    """The mask as an additive fp32 bias [rows, max_blocks * BLOCK_SIZE, 1] (0 or -inf), for
    the BLAS decode of groups of several rows; built with the metadata when a backend asks."""


@dataclass
class AttentionMetadata:
    """The torch-family backends' metadata (``torch``, ``cpu-blas``, ``cpu-native``)."""

    slot_mapping: torch.Tensor
    """Long [num_tokens]: cache slot of each new token's K and V."""
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    """Single-token queries (one per request), first in the batch, split by context length
    so padding stays small."""
    prefills: list[PrefillSeq] = field(default_factory=list)


def decode_groups(decodes: list[SeqSpan]) -> list[tuple[int, int]]:
    """Index ranges of ``decodes`` (longest context first) whose shortest member needs at least
    7/8 of the longest's blocks, so a padded batch wastes little gather and matmul work."""
    ranges, start = [], 0
    while start < len(decodes):
        width = len(decodes[start].block_ids)
        end = start + 1
        while end < len(decodes) and 8 * len(decodes[end].block_ids) >= 7 * width:
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def build_torch_metadata(batch: AttentionBatch, device: torch.device, bias: bool = False) -> AttentionMetadata:
    """Padded int64 block tables and masks per decode group, a mask per prefill chunk with
    earlier context; ``bias``: also each multi-row group's mask as an additive bias."""
    meta = AttentionMetadata(batch.slot_mapping)
    for a, b in decode_groups(batch.decodes):
        spans = batch.decodes[a:b]
        width = max(len(s.block_ids) for s in spans)
        table = torch.zeros(len(spans), width, dtype=torch.long)
        for i, s in enumerate(spans):
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids)
        lens = torch.tensor([s.context_len for s in spans], dtype=torch.long)
        mask = torch.arange(width * BLOCK_SIZE)[None, :] < lens[:, None]
        first = spans[0].block_ids[0]
        consecutive = len(spans) == 1 and spans[0].block_ids == list(range(first, first + width))
        group = DecodeGroup(spans[0].start, spans[-1].end, table.to(device), mask[:, None, None, :].to(device),
                            spans[0].context_len, lens, first if consecutive else None)
        if bias and len(spans) > 1:
            group.bias = mask_bias(group.mask, len(spans))
        meta.decode_groups.append(group)
    for s in batch.prefills:
        n = s.end - s.start
        blocks = torch.tensor(s.block_ids, dtype=torch.long)
        mask = None
        if s.context_len > n:
            # Row i (position start + i) sees context positions j <= start + i.
            pos = torch.arange(s.context_len - n, s.context_len)
            mask = (torch.arange(s.context_len)[None, :] <= pos[:, None]).to(device)
        meta.prefills.append(PrefillSeq(s.start, s.end, s.context_len, blocks.to(device), mask,
                                        torch.arange(s.context_len - n + 1, s.context_len + 1)))
    return meta


def mask_bias(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """A decode group's bool mask as an fp32 additive bias [rows, positions, 1]."""
    m = mask.view(rows, -1, 1)
    return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
