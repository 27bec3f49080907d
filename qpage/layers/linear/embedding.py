"""The token embedding [vocab, hidden], and the LM head when the model ties it to the embedding.

Dense (a safetensors checkpoint: ``weight``, filled by the loader) or one tensor of a GGUF file
(``value``, kept as loaded). ``prepare`` hands it to the linear kernel selector as a table
(``LinearSpec.table``): the chosen kernel gives both the row lookup and, when tied, the head's
matmul over the same weight, so a packed table is held once and read by the block kernels.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from qpage.layers.linear.block_linear import Part, check_shape, dequantized, ggml_type
from qpage.layers.linear.kernel_spec import LinearSpec, Matmul
from qpage.layers.linear.linear_kernels import build_linear
from qpage.layers.linear.quant_base import Splitter


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, packed: bool, tied: bool) -> None:
        """``packed``: the weight comes from a GGUF file (``load_part``), else into ``weight``;
        ``tied``: the LM head multiplies with this table (``head``)."""
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tied = num_embeddings, embedding_dim, tied
        self.weight = None if packed else nn.Parameter(torch.empty(num_embeddings, embedding_dim),
                                                      requires_grad=False)
        self.value: Part | None = None
        """A GGUF file's tensor, as loaded (until ``prepare``)."""
        self.bias = None
        self.kernel_path = "unprepared"
        self.weight_bytes = 0
        self._rows: Matmul | None = None
        self._head: Matmul | None = None
        self.own_threads = False
        """Whether the tied head's matmul splits its rows across the cores itself."""
        self.register_buffer("anchor", torch.empty(0), persistent=False)  # follows the model's device

    @property
    def packed(self) -> bool:
        """Whether the table comes from a GGUF file (its blocks kept where a kernel reads them)."""
        return self.weight is None

    # A GGUF file's table, loaded by the model loader as a quantized target.
    def wants(self, parts: dict[str, Part]) -> bool:
        return "weight" in parts

    def load_part(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str) -> None:
        value = parts["weight"]
        check_shape(prefix, value, self.num_embeddings, self.embedding_dim, file)
        self.value = value

    def load_split(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str,
                   split: Splitter) -> None:
        """A split model's ``load_part``: this rank's token rows."""
        self.load_part(prefix, {"weight": split.tensor_part(f"{prefix}.weight", parts["weight"])}, offset, cols, file)

    def unread_parts(self) -> tuple[str, ...]:
        return ()

    # What the kernels read (``linear_kernels``).
    @property
    def parts(self) -> list[tuple[int, Part]]:
        return [] if self.value is None else [(0, self.value)]

    def dequantized_in_out(self) -> torch.Tensor:
        assert self.value is not None
        return dequantized(self.value).t().to(self.anchor.device)

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        if self.packed and self.value is None:
            raise RuntimeError("the embedding has no weight; load_weights checks for it")
        types = (ggml_type(self.value),) if self.value is not None else ()
        return LinearSpec("blocks" if self.packed else "dense", self.anchor.device, dtype, self.embedding_dim,
                          self.num_embeddings, ggml_types=types, table=True, multiplies=self.tied)

    def prepare(self, dtype: torch.dtype, dequantize: bool = False) -> None:
        """Choose the kernel once the table is loaded and on its device (``dequantize``: no
        packed kernel, as for the linears)."""
        kernel, built = build_linear(self, replace(self.spec(dtype), dequantize=dequantize))
        assert built.rows is not None, f"{kernel.name} looks up rows of a table"
        self._rows, self.kernel_path, self.weight_bytes = built.rows, kernel.name, built.weight_bytes
        self._head = built.mm if self.tied else None
        self.own_threads = built.own_threads
        if not built.keeps_packed:
            self.value = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> rows [T, hidden]."""
        if self._rows is None:
            raise RuntimeError("the embedding runs only after prepare() (the model loader calls it)")
        return self._rows(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: hidden [T, hidden] -> logits [T, vocab], on this same table."""
        assert self._head is not None, "a tied head, after prepare()"
        return self._head(hidden)

