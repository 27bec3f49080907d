"""Kernel tests run under Triton's interpreter on CPU (set in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.triton_utils import HAS_TRITON, INTERPRET

if not HAS_TRITON:  # pragma: no cover
    pytest.skip("Triton is not installed", allow_module_level=True)
if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm())


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
