"""What every quantized linear shares: the bias, and the kernel chosen once at ``prepare``
(``linear_kernels``), recorded as ``kernel_path`` with the bytes its weight occupies."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from qpage.layers.linear.kernel_spec import LinearSpec, Matmul
from qpage.layers.linear.linear_kernels import build_linear


class Splitter(Protocol):
    """What one rank of a split model takes of a checkpoint projection, by the form its layer
    holds it in (``models.sharding.Rank``). A layer's ``load_split`` validates the projection at
    the whole model's shape, asks for its part, and stores it; the methods that return input
    columns give, for a row-parallel part that gathers its input, the global columns it reads
    (else None)."""

    def whole_shape(self, prefix: str) -> tuple[int, int]:
        """(in_features, out_features) of the whole model's projection ``prefix``."""
        ...

    def int_part(self, prefix: str, parts: dict[str, Any], cfg: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        """This rank's part of an integer projection in the GPTQ layout, and its input columns."""
        ...

    def fp8_part(self, prefix: str, codes: Any, scale: torch.Tensor, block: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's FP8 codes and scale, and its input columns."""
        ...

    def tensor_part(self, name: str, value: Any) -> Any:
        """This rank's rows or columns of a dense or block tensor (blocks cut between blocks)."""
        ...


class QuantLinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel_path = "unprepared"
        """The chosen kernel's name (``linear_kernels``)."""
        self.weight_bytes = 0
        """Bytes the weight occupies in memory on the chosen path."""
        self._mm: Matmul | None = None
        self.kernel_mm: Matmul | None = None
        """The chosen kernel's own matmul, before ``build_linear`` adds the bias to it (a kernel
        that fuses the bias adds it here too): what a fused caller runs itself."""
        self.own_threads = False
        """Whether the matmul splits its rows across the cores itself (``Built.own_threads``)."""

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        """What the kernel must handle, for activations of ``dtype``."""
        raise NotImplementedError

    def dequantized_in_out(self) -> torch.Tensor:
        """The fp32 weight [in, out]."""
        raise NotImplementedError

    def drop_packed(self) -> None:
        """Release the packed tensors (the chosen kernel built its own copy)."""
        raise NotImplementedError

    def prepare(self, dtype: torch.dtype, dequantize: bool = False) -> None:
        """Choose and build the kernel, once the weights are loaded and on their device;
        ``dequantize`` asks for the weight dequantized once rather than kept packed."""
        kernel, built = build_linear(self, replace(self.spec(dtype), dequantize=dequantize))
        self._mm, self.kernel_path, self.weight_bytes = built.mm, kernel.name, built.weight_bytes
        self.kernel_mm, self.own_threads = built.kernel_mm, built.own_threads
        if not built.keeps_packed:
            self.drop_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mm is None:
            raise RuntimeError("a quantized linear runs only after prepare() (the model loader calls it)")
        return self._mm(x)
