"""The one factory every linear layer of a model comes from, and the dense linear.

Quantized schemes (INT4/INT8/FP8, block formats) swap in here, so model code never assumes a
dense matrix; a tensor-parallel rank builds the same layers at its part's size.
"""

from __future__ import annotations

import torch
from torch import nn

from qpage.formats.bnb import BnbConfig
from qpage.formats.detect import LinearConfig
from qpage.formats.fp8 import Fp8Config
from qpage.formats.gguf_model import GgufConfig
from qpage.formats.mxfp4 import Mxfp4Config
from qpage.layers.linear.block_linear import BlockLinear
from qpage.layers.linear.fp8_linear import Fp8Linear
from qpage.layers.linear.kernel_spec import LinearSpec, Matmul
from qpage.layers.linear.linear_kernels import build_linear
from qpage.layers.linear.quant_linear import IntLinear


class Linear(nn.Module):
    """y = x W^T + b. ``weight`` is [out, in] for loading; ``prepare`` picks the kernel, and
    ``weight`` is None afterwards where the kernel holds the weight in its own layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel_path = "unprepared"
        self.weight_bytes = 0
        """Bytes the weight occupies in memory on the chosen path."""
        self.own_threads = False
        """Whether the matmul splits its rows across the cores itself (``Built.own_threads``)."""
        self._mm: Matmul | None = None

    def prepare(self, in_place: bool = False) -> None:
        """Called once the weights are loaded and on their device. ``in_place``: ``weight``
        will be rewritten where it lies and the matmul must see it (``LinearSpec.in_place``)."""
        assert self.weight is not None, "prepare() runs once"
        w = self.weight.data
        spec = LinearSpec("dense", w.device, w.dtype, self.in_features, self.out_features, in_place=in_place)
        kernel, built = build_linear(self, spec)
        self._mm, self.kernel_path, self.weight_bytes = built.mm, kernel.name, built.weight_bytes
        self.own_threads = built.own_threads
        if built.drops_weight:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mm is None:
            raise RuntimeError("a linear runs only after prepare() (the model loader calls it)")
        return self._mm(x)


def make_linear(in_features: int, out_features: int, bias: bool, quant: LinearConfig | None = None) -> nn.Module:
    """A dense ``Linear``, or the quantized layer for ``quant``."""
    if quant is None:
        return Linear(in_features, out_features, bias)
    if isinstance(quant, Fp8Config):
        return Fp8Linear(in_features, out_features, bias, quant)
    if isinstance(quant, (GgufConfig, BnbConfig, Mxfp4Config)):
        return BlockLinear(in_features, out_features, bias, quant)
    return IntLinear(in_features, out_features, bias, quant)
