"""Layers whose weights are in a block format of the CPU kernels: a linear (possibly fused
from several projections, each in its own format) from a GGUF file, a bitsandbytes 4-bit or
an MXFP4 (gpt-oss) checkpoint (a GGUF file's token embedding: ``layers.linear.embedding``).

The parts are kept as loaded (``formats.gguf_model.GgufTensor``, ``formats.bnb.Bnb4Tensor``,
or fp32 for float tensors); ``prepare`` hands them to the kernel selector (``linear_kernels``), which
keeps block formats packed where a kernel runs them (``cpu-blocks``) and otherwise, or when
``dequantize_weights`` asks, dequantizes once.
"""

from __future__ import annotations

import torch

from qpage.formats import bnb
from qpage.formats.gguf_model import GgufConfig, GgufTensor
from qpage.formats.gguf_reader import F32
from qpage.formats.mxfp4 import Mxfp4Config
from qpage.layers.linear.kernel_spec import LinearSpec
from qpage.layers.linear.quant_base import QuantLinearBase, Splitter

Part = GgufTensor | torch.Tensor


def check_shape(prefix: str, value: Part, rows: int, cols: int, file: str) -> None:
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
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 cfg: GgufConfig | bnb.BnbConfig | Mxfp4Config) -> None:
        super().__init__(in_features, out_features, bias)
        self.cfg = cfg
        self.parts: list[tuple[int, Part]] = []
        """(first output row, weight [rows, in]) per projection, in row order."""
        self.register_buffer("anchor", torch.empty(0), persistent=False)  # follows the model's device

    def wants(self, parts: dict[str, Part]) -> bool:
        return self.cfg.wants(parts)  # type: ignore[arg-type]

    def load_part(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str) -> None:
        self.store_part(prefix, self.check_part(prefix, parts, self.in_features, cols, file), offset, cols, file)

    def load_split(self, prefix: str, parts: dict[str, Part], offset: int, cols: int, file: str,
                   split: Splitter) -> None:
        """A split model's ``load_part``: this rank's rows or columns, cut between blocks."""
        value = split.tensor_part(f"{prefix}.weight", self.check_part(prefix, parts, *split.whole_shape(prefix), file))
        self.store_part(prefix, value, offset, cols, file)

    def unread_parts(self) -> tuple[str, ...]:
        return ()

    def check_part(self, prefix: str, parts: dict[str, Part], in_features: int, cols: int, file: str) -> Part:
        """One projection's weight [cols, in_features] as its format holds it, validated."""
        value = self.cfg.linear_part(prefix, parts, in_features, cols, file)  # type: ignore[arg-type]
        check_shape(prefix, value, cols, in_features, file)
        return value

    def store_part(self, prefix: str, value: Part, offset: int, cols: int, file: str) -> None:
        """Keep ``check_part``'s result (or a rank's slice of it) as output rows [offset, offset + cols)."""
        check_shape(prefix, value, cols, self.in_features, file)
        self.parts = sorted([*self.parts, (offset, value)], key=lambda p: p[0])

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec("blocks", self.anchor.device, dtype, self.in_features, self.out_features,
                          ggml_types=tuple(ggml_type(v) for _, v in self.parts))

    def dequantized_in_out(self) -> torch.Tensor:
        return torch.cat([dequantized(v) for _, v in self.parts]).t().to(self.anchor.device)

    def drop_packed(self) -> None:
        self.parts = []
