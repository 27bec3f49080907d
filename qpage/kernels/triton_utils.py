"""Triton import shim and launch helpers shared by the kernel modules.

Triton is optional: on a machine without it (macOS, a CPU-only install) the kernel modules
still import, their ``*_ref`` functions work, and ``HAS_TRITON`` is False so the selectors
fall back to the torch paths with that reason. ``TRITON_INTERPRET=1`` (read once, when
Triton is imported) runs the kernels on CPU tensors; tests set it in ``conftest.py``.
"""

import importlib.util
import os
from typing import Any

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Kernels run in Triton's CPU interpreter: bf16/fp8 arithmetic there is wrong, so kernels
upcast to fp32 before any arithmetic or ``tl.dot``."""

INSTALLED = importlib.util.find_spec("triton") is not None
WANTED = INSTALLED and (INTERPRET or torch.cuda.is_available())
"""Triton is imported only where a kernel of it can run (a CUDA device, or the interpreter):
on a CPU-only machine importing it would cost memory for nothing."""

if WANTED:
    import triton
    import triton.language as tl

    HAS_TRITON = True
else:
    HAS_TRITON = False

    class _Stub:
        """Stands in for ``triton`` / ``tl`` so kernel modules define their functions."""

        constexpr = Any

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            def wrap(f: Any) -> Any:
                def missing(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError("Triton is not installed: `pip install triton` or use the torch path")

                return missing

            return wrap(fn) if fn is not None else wrap

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    triton = _Stub()  # type: ignore[assignment]
    tl = _Stub()  # type: ignore[assignment]


def triton_unavailable_reason(device_type: str) -> str | None:
    """Why Triton kernels cannot run on this device, or None when they can."""
    if not INSTALLED:
        return "Triton is not installed"
    if HAS_TRITON and (device_type == "cuda" or INTERPRET):
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1); got {device_type}"


__all__ = ["HAS_TRITON", "INTERPRET", "tl", "triton", "triton_unavailable_reason"]
