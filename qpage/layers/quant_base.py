"""What every quantized linear shares: the bias, the kernel-path record, and the
dequantize-once dense path (the CPU design; on CUDA without a kernel, a reported fallback)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qpage.kernels import cpu_matmul


class QuantLinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel_path = "unprepared"
        """How forward runs: triton-fused (CUDA), cpu-dequantized (CPU design), dequantized-fallback."""
        self._dense: torch.Tensor | None = None
        self._w_t = None

    def use_dense(self, w_in_out: torch.Tensor, dtype: torch.dtype) -> None:
        """Run from the dequantized weight [in, out] from now on (the caller drops the packed tensors)."""
        dev = w_in_out.device
        self.kernel_path = "cpu-dequantized" if dev.type == "cpu" else "dequantized-fallback"
        if cpu_matmul.supports(dtype, dev):
            self._w_t = w_in_out.to(dtype).contiguous().numpy()
        else:
            self._dense = w_in_out.t().to(dtype).contiguous()

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The fused kernel on the packed weight (CUDA)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._w_t is not None:
            y = cpu_matmul.matmul_wt(x, self._w_t)
        elif self._dense is not None:
            y = F.linear(x, self._dense)
        else:
            y = self.fused(x)
        return y + self.bias if self.bias is not None else y
