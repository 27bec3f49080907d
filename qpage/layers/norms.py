"""RMSNorm, computed in fp32 like the reference implementations, through the model's ops
(``ops``: chosen once per model at ``prepare``)."""

from __future__ import annotations

import torch
from torch import nn

from qpage.layers.ops import TORCH_OPS, TorchOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops: TorchOps = TORCH_OPS

    def prepare(self) -> None:
        """Fix what the weights imply, once they are loaded (nothing here)."""

    def effective_weight(self) -> torch.Tensor:
        """What the normalised values are multiplied by."""
        return self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; or, given ``residual``, vLLM's fused form: ``residual = x + residual``
        and ``(norm(residual), residual)`` (in place on both with the C kernels)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
