"""The one factory every linear layer of a model comes from, and the dense linear.

Quantized schemes (INT4/INT8/FP8) and tensor-parallel shards swap in here, so model code
never assumes a whole dense matrix.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qpage.kernels import cpu_matmul


class Linear(nn.Module):
    """y = x W^T + b. ``weight`` is [out, in] for loading; ``prepare`` picks the kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._w_t: np.ndarray | None = None

    def prepare(self) -> None:
        """Called once the weights are loaded and on their device."""
        w = self.weight.data
        if cpu_matmul.supports(w.dtype, w.device):
            # Store W transposed ([in, out] contiguous); `weight` stays an [out, in] view of it.
            w_t = w.t().contiguous()
            self.weight.data = w_t.t()
            self._w_t = w_t.numpy()
        else:
            self._w_t = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._w_t is not None:
            y = cpu_matmul.matmul_wt(x, self._w_t)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


def make_linear(in_features: int, out_features: int, bias: bool, quant: object | None = None) -> nn.Module:
    """A dense ``Linear``, or the quantized layer for ``quant`` (a ``formats.detect.LinearConfig``)."""
    if quant is None:
        return Linear(in_features, out_features, bias)
    from qpage.formats.fp8 import Fp8Config
    from qpage.layers.fp8_linear import Fp8Linear
    from qpage.layers.quant_linear import IntLinear

    if isinstance(quant, Fp8Config):
        return Fp8Linear(in_features, out_features, bias, quant)
    return IntLinear(in_features, out_features, bias, quant)  # type: ignore[arg-type]
