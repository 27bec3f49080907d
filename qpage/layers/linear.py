"""The one factory every linear layer of a model comes from.

Quantized schemes (INT4/INT8/FP8) and tensor-parallel shards swap in here, so model code
never assumes a whole dense matrix.
"""

from __future__ import annotations

from torch import nn


def make_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A dense linear; its weight is filled by the loader, so it starts uninitialised."""
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    return layer.to_empty(device="cpu").requires_grad_(False)
