"""What every quantized linear shares: the bias, the kernel-path record, the packed CPU
path, and the dequantize-once dense path (the fp32 CPU design; on CUDA without a kernel,
a reported fallback)."""

from __future__ import annotations

from collections.abc import Callable

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
        """How forward runs: triton-fused (CUDA), cpu-int4pack / cpu-int8pack (CPU, packed
        weights, bf16), cpu-dequantized (CPU, fp32), dequantized-fallback (CUDA, no kernel)."""
        self.weight_bytes = 0
        """Bytes the weight occupies in memory on the chosen path."""
        self._dense: torch.Tensor | None = None
        self._w_t = None
        self._packed_mm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_dense(self, w_in_out: torch.Tensor, dtype: torch.dtype) -> None:
        """Run from the dequantized weight [in, out] from now on (the caller drops the packed tensors)."""
        dev = w_in_out.device
        self.kernel_path = "cpu-dequantized" if dev.type == "cpu" else "dequantized-fallback"
        if cpu_matmul.supports(dtype, dev):
            self._w_t = w_in_out.to(dtype).contiguous().numpy()
            self.weight_bytes = self._w_t.nbytes
        else:
            self._dense = w_in_out.t().to(dtype).contiguous()
            self.weight_bytes = self._dense.numel() * self._dense.element_size()

    def use_packed(self, path: str, mm: Callable[[torch.Tensor], torch.Tensor], nbytes: int) -> None:
        """Run through a packed CPU kernel (``kernels.cpu_packed``) from now on."""
        self.kernel_path, self._packed_mm, self.weight_bytes = path, mm, nbytes

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The fused kernel on the packed weight (CUDA)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._w_t is not None:
            y = cpu_matmul.matmul_wt(x, self._w_t)
        elif self._dense is not None:
            y = F.linear(x, self._dense)
        elif self._packed_mm is not None:
            y = self._packed_mm(x)
        else:
            y = self.fused(x)
        return y + self.bias if self.bias is not None else y
