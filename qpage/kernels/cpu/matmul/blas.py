"""Dense fp32 matmul on CPU through NumPy's BLAS (OpenBLAS).

Why: decode at small batch is bound by reading the weights, and OpenBLAS streams them about
twice as fast as torch's own sgemv/sgemm on the CPUs measured (docs/cpu.md). The weight is
kept transposed, ``[in, out]`` contiguous, OpenBLAS's fastest layout at every batch size.
``torch.from_numpy`` and ``Tensor.numpy`` share memory, so no copies are made.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_info, threadpool_limits


def supports(x_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and x_dtype == torch.float32


_START_THREADS = max((d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"), default=None)
"""The BLAS pool's size when qpage was imported (what ``set_threads(None)`` restores)."""


def set_threads(n: int | None) -> None:
    """Limit NumPy's BLAS to ``n`` threads for the whole process (None: back to the size it
    started with, at most the cores this process may run on). Idle OpenBLAS threads spin for
    a while after each call, so beside the block-format kernels' own OpenMP threads a second
    busy pool slows both (prefill of the default model's GGUF ran about 1.4x faster with one
    BLAS thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    limit = n if n is not None else min(_START_THREADS, cores) if _START_THREADS and cores else _START_THREADS
    if limit is not None:
        threadpool_limits(limits=limit, user_api="blas")


def matmul_wt(x: torch.Tensor, w_t: np.ndarray) -> torch.Tensor:
    """``x @ w_t`` for x fp32 [M, in] on CPU and w_t fp32 [in, out] (NumPy, contiguous)."""
    return torch.from_numpy(np.matmul(x.numpy(), w_t))


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: torch's own linear, weight [out, in]."""
    return F.linear(x, weight, bias)
