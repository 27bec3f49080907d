"""Dense fp32 matmul on CPU through NumPy's BLAS (OpenBLAS).

Why: on this project's CPUs (AMD EPYC) torch's MKL sgemv/sgemm reaches ~12 GB/s at
batch 1 while OpenBLAS reaches 25-30 GB/s on the same weights (measured, see
benchmarks/throughput.py), and decode at small batch is bound by reading the weights.
The weight is kept transposed, ``[in, out]`` contiguous, which is OpenBLAS's fastest
layout at every batch size measured (1..256). ``torch.from_numpy`` and ``Tensor.numpy``
share memory, so no copies are made.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def supports(x_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and x_dtype == torch.float32


def matmul_wt(x: torch.Tensor, w_t: np.ndarray) -> torch.Tensor:
    """``x @ w_t`` for x fp32 [M, in] on CPU and w_t fp32 [in, out] (NumPy, contiguous)."""
    return torch.from_numpy(np.matmul(x.numpy(), w_t))


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: torch's own linear, weight [out, in]."""
    return F.linear(x, weight, bias)
