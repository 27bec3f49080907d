"""RMSNorm, computed in fp32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qpage.kernels import cpu_native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.native = False
        """fp32 on CPU with the C kernels loaded (set by the model's ``prepare``)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; or, given ``residual``, vLLM's fused form: ``residual = x + residual``
        and ``(norm(residual), residual)``. The native path works in place on both."""
        if residual is None:
            return cpu_native.rms_norm(x, self.weight, self.eps) if self.native else self._norm(x)
        if self.native:
            cpu_native.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in fp32, round, then scale (as the reference models do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
