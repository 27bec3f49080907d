"""Layers whose weights are in a block format of the CPU kernels: a linear (possibly fused
from several projections, each in its own format) from a GGUF file or a bitsandbytes 4-bit
checkpoint, and a GGUF file's token embedding.

The parts are kept as loaded (``formats.gguf_model.GgufTensor``, ``formats.bnb.Bnb4Tensor``,
or fp32 for float tensors); ``prepare`` hands them to the kernel selector (``linear_kernels``), which
keeps block formats packed where a kernel runs them (``cpu-blocks``) and otherwise, or when
``dequantize_weights`` asks, dequantizes once. The embedding reads its rows from the same packed table the tied LM head
multiplies with, so a tied table is held once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qpage.formats import bnb
from qpage.formats.gguf_model import GgufConfig, GgufTensor
from qpage.formats.gguf_reader import F32
from qpage.kernels.cpu import native_gguf
from qpage.layers.linear_kernels import LinearSpec, Matmul, blocks_reason, tied_head
from qpage.layers.quant_base import QuantLinearBase

Part = GgufTensor | torch.Tensor


def _check(prefix: str, value: Part, rows: int, cols: int, file: str) -> None:
    shape = value.shape if isinstance(value, GgufTensor) else tuple(value.shape)
    if tuple(shape) != (rows, cols):
        raise ValueError(f"{file}: tensor {prefix}.weight has shape {tuple(shape)}, expected {(rows, cols)} from the "
                         "file's metadata; the file is inconsistent")


def ggml_type(value: Part) -> int:
    return value.ggml_type if isinstance(value, GgufTensor) else F32


def dequantized(value: Part) -> torch.Tensor:
    """fp32 [out, in]."""
    return value.dequantize() if isinstance(value, GgufTensor) else value.float()


class BlockLinear(QuantLinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: GgufConfig | bnb.BnbConfig) -> None:
        super().__init__(in_features, out_features, bias)
        self.cfg = cfg
        self.parts: list[tuple[int, Part]] = []
        """(first output row, weight [rows, in]) per projection, in row order."""
        self.register_buffer("anchor", torch.empty(0), persistent=False)  # follows the model's device

    def wants(self, parts: dict[str, Part]) -> bool:
        return self.cfg.wants(parts)  # type: ignore[arg-type]

    def load_part(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str) -> None:
        self.store_part(prefix, self.check_part(prefix, parts, self.in_features, cols, file), offset, cols, file)

    def check_part(self, prefix: str, parts: dict[str, Part], in_features: int, cols: int, file: str) -> Part:
        """One projection's weight [cols, in_features] as its format holds it, validated."""
        value = self.cfg.linear_part(prefix, parts, in_features, cols, file)  # type: ignore[arg-type]
        _check(prefix, value, cols, in_features, file)
        return value

    def store_part(self, prefix: str, value: Part, offset: int, cols: int, file: str) -> None:
        """Keep ``check_part``'s result (or a rank's slice of it) as output rows [offset, offset + cols)."""
        _check(prefix, value, cols, self.in_features, file)
        self.parts = sorted([*self.parts, (offset, value)], key=lambda p: p[0])

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec("blocks", self.anchor.device, dtype, self.in_features, self.out_features,
                          ggml_types=tuple(ggml_type(v) for _, v in self.parts))

    def dequantized_in_out(self) -> torch.Tensor:
        return torch.cat([dequantized(v) for _, v in self.parts]).t().to(self.anchor.device)

    def drop_packed(self) -> None:
        self.parts = []


class GgufEmbedding(nn.Module):
    """The token embedding [vocab, hidden]: packed when the native kernels run its format
    (unless ``prepare`` is asked to dequantize), else dequantized once to the model's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.value: Part | None = None
        self.packed: native_gguf.PackedWeight | None = None
        self.dense: torch.Tensor | None = None
        self.kernel_path = "unprepared"
        self.weight_bytes = 0
        self.register_buffer("anchor", torch.empty(0), persistent=False)

    def wants(self, parts: dict[str, Part]) -> bool:
        return "weight" in parts

    def load_part(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str) -> None:
        value = parts["weight"]
        _check(prefix, value, self.num_embeddings, self.embedding_dim, file)
        self.value = value

    def prepare(self, dtype: torch.dtype, dequantize: bool = False) -> None:
        if self.value is None:
            raise RuntimeError("the embedding has no weight; load_weights checks for it")
        v = self.value
        why = blocks_reason(self.anchor.device, (ggml_type(v),), self.embedding_dim)
        if isinstance(v, GgufTensor) and why is None and not dequantize:
            self.packed = native_gguf.repack(v.rows, v.ggml_type, self.embedding_dim)
            self.kernel_path, self.weight_bytes = "cpu-blocks", self.packed.data.numel()
        else:
            self.dense = dequantized(v).to(self.anchor.device, dtype)
            self.kernel_path = "dense"
            self.weight_bytes = self.dense.numel() * self.dense.element_size()
        self.value = None
        self._dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return native_gguf.dequantize_rows(self.packed, ids).to(self._dtype)
        assert self.dense is not None, "the embedding runs only after prepare()"
        return F.embedding(ids, self.dense)

    def head(self) -> Matmul:
        """The tied LM head: hidden [T, hidden] -> logits [T, vocab], on this same table."""
        if self.packed is not None:
            return native_gguf.PiecewiseMatmul([(0, self.num_embeddings, self.packed)], self.embedding_dim,
                                               self.num_embeddings)
        assert self.dense is not None, "the head runs only after prepare()"
        dense = self.dense
        return tied_head(dense) or (lambda h: F.linear(h, dense))
