"""FP8 (E4M3) weight matmul, per-channel and 128x128 block scales, against the torch reference.

Tolerances as for the integer kernels (||out - ref|| / ||ref||): fp32 1e-5, fp16 2e-3, bf16 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.configs import MatmulConfig
from qpage.kernels.fp8.matmul import dequantize_fp8_weight_ref, fp8_matmul, fp8_matmul_ref
from tests.kernels.conftest import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make(n: int, k: int, block: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-n // 128), -(-k // 128)) if block else (n,)
    return w, torch.rand(shape, generator=g) * 0.01 + 1e-3


def test_block_scale_reference() -> None:
    w, s = make(200, 300, block=True)
    full = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert torch.equal(dequantize_fp8_weight_ref(w, s), full)
    w, s = make(64, 96, block=False)
    assert torch.equal(dequantize_fp8_weight_ref(w, s), w.float() * s[:, None])


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block128"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 192, 320), (9, 256, 256), (40, 136, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fp8_matmul_matches_ref(block: bool, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    w, s = make(n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = fp8_matmul(x, w, s)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, fp8_matmul_ref(x, w, s)) < TOL[dtype]
    # uint8 codes (as stored by qpage) give the same result, and so does split K.
    assert torch.equal(fp8_matmul(x, w.view(torch.uint8), s), out)
    split = fp8_matmul(x, w, s, MatmulConfig(16, 64, 64, split_k=3))
    assert rel_err(split, fp8_matmul_ref(x, w, s)) < TOL[dtype]
