"""A split model's layers that talk to the other ranks (Megatron style; the split itself:
``models.sharding``). Each wraps the rank's own part, built and loaded like any layer, and
adds its collective, so model code calls them as it calls the whole layer.

- ``RowParallel``: a projection over this rank's input columns (o_proj, down_proj) whose
  partial sums are all-reduced; when those columns are not the rank's own input columns
  (quantization groups split in act-order, or a group across a head boundary) the input is
  all-gathered first and the columns picked.
- ``VocabParallelEmbedding``: this rank's token rows; a token elsewhere looks up zeros, and the
  rows are all-reduced. Its tied head, like ``VocabParallelHead``, gathers the logits'
  vocabulary columns to rank 0 (None on the others).
"""

from __future__ import annotations

import torch
from torch import nn

from qpage.layers.linear.embedding import Embedding
from qpage.parallel.comm import Collectives


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, comm: Collectives, widths: list[int], cols: torch.Tensor | None) -> None:
        """``widths``: every rank's own input columns (the all-gather's); ``cols``: the global
        input columns this part reads, or None when it reads its own input as it is."""
        super().__init__()
        self.inner, self.comm, self.widths, self.cols = inner, comm, widths, cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cols is not None:
            x = self.comm.all_gather_cols(x, self.widths)[:, self.cols]
        return self.comm.all_reduce(self.inner.forward(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: Embedding, vocab: tuple[int, int], comm: Collectives, widths: list[int]) -> None:
        """``vocab``: this rank's token rows [start, stop); ``widths``: every rank's row count."""
        super().__init__()
        self.inner, self.vocab, self.comm, self.widths = inner, vocab, comm, widths

    @property
    def packed(self) -> bool:
        return self.inner.packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v0, v1 = self.vocab
        inside = (ids >= v0) & (ids < v1)
        h = self.inner.forward(torch.where(inside, ids - v0, 0))
        h.masked_fill_(~inside[:, None], 0.0)
        return self.comm.all_reduce(h)

    def head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.comm.gather_cols(self.inner.head(hidden), self.widths)


class VocabParallelHead(nn.Module):
    def __init__(self, inner: nn.Module, comm: Collectives, widths: list[int]) -> None:
        super().__init__()
        self.inner, self.comm, self.widths = inner, comm, widths

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.comm.gather_cols(self.inner.forward(hidden), self.widths)
