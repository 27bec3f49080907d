"""The one factory every linear layer of a model comes from, and the dense linear.

Quantized schemes (INT4/INT8/FP8) and tensor-parallel shards swap in here, so model code
never assumes a whole dense matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from qpage.formats.detect import LinearConfig
from qpage.formats.fp8 import Fp8Config
from qpage.layers.fp8_linear import Fp8Linear
from qpage.layers.linear_kernels import LinearSpec, Matmul, select_linear_kernel
from qpage.layers.quant_linear import IntLinear


class Linear(nn.Module):
    """y = x W^T + b. ``weight`` is [out, in] for loading; ``prepare`` picks the kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel_path = "unprepared"
        self.weight_bytes = 0
        """Bytes the weight occupies in memory on the chosen path."""
        self._mm: Matmul | None = None
        self._add_bias = bias

    def prepare(self) -> None:
        """Called once the weights are loaded and on their device."""
        w = self.weight.data
        spec = LinearSpec("dense", w.device, w.dtype, self.in_features, self.out_features)
        kernel = select_linear_kernel(spec)
        built = kernel.build(self, spec)
        self._mm, self.kernel_path, self.weight_bytes = built.mm, kernel.name, built.weight_bytes
        self._add_bias = self.bias is not None and not built.adds_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mm is None:
            raise RuntimeError("a linear runs only after prepare() (the model loader calls it)")
        y = self._mm(x)
        return y + self.bias if self._add_bias else y


def make_linear(in_features: int, out_features: int, bias: bool, quant: LinearConfig | None = None) -> nn.Module:
    """A dense ``Linear``, or the quantized layer for ``quant``."""
    if quant is None:
        return Linear(in_features, out_features, bias)
    if isinstance(quant, Fp8Config):
        return Fp8Linear(in_features, out_features, bias, quant)
    return IntLinear(in_features, out_features, bias, quant)
