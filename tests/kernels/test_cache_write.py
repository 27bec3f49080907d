"""Cache write with FP8 quantization: bit-exact with torch's float8 conversion of x / scale."""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.attention.cache_write import write_kv_cache
from qpage.kernels.kv_quant import per_token_scales_ref, quantize_kv_ref, write_kv_cache_ref


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t, kvh, hd, nb = 40, 3, 64, 8
    # Magnitudes from 1e-4 to 1e3 across tokens; a zero head and an outlier channel.
    k = torch.randn(t, kvh, hd, generator=g) * torch.logspace(-4, 3, t)[:, None, None]
    k[0, 1] = 0.0
    k[5, 0, 3] = 5000.0
    v = torch.randn(t, kvh, hd, generator=g)
    slots = torch.randperm(nb * 16, generator=g)[:t]
    slots[7] = -1  # padding: skipped
    return k.to(dtype), v.to(dtype), slots


MODES = [("e4m3", True), ("e4m3", False), ("e5m2", True), ("e5m2", False), (None, False)]


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "per_token"), MODES,
                         ids=["e4m3-token", "e4m3-tensor", "e5m2-token", "e5m2-tensor", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cache_write_bit_exact(fmt: str | None, per_token: bool, dtype: torch.dtype) -> None:
    k, v, slots = _inputs(dtype)
    results = []
    for fn in (write_kv_cache, write_kv_cache_ref):
        kc = torch.zeros(8, 16, 3, 64, dtype=torch.uint8 if fmt else dtype)
        vc = torch.zeros_like(kc)
        if fmt and per_token:
            ks, vs = torch.zeros(8, 16, 3, dtype=torch.float16), torch.zeros(8, 16, 3, dtype=torch.float16)
        elif fmt:
            ks, vs = torch.tensor([0.37]), torch.tensor([0.011])
        else:
            ks = vs = None
        fn(k, v, kc, vc, slots, ks, vs, fmt)
        results.append((kc, vc, ks, vs))
    for got, want in zip(*results, strict=True):
        if got is not None:
            assert torch.equal(got, want)
    kc = results[0][0]
    keep = slots >= 0
    if fmt and per_token:
        # The reference itself is torch's conversion of x / scale, saturated at the format's max.
        scale = per_token_scales_ref(k[keep], fmt)
        assert torch.equal(kc.view(-1, 3, 64)[slots[keep]], quantize_kv_ref(k[keep], scale, fmt))
        assert (results[0][2].view(-1, 3)[slots[keep]] == scale).all()
    elif fmt is None:
        assert torch.equal(kc.view(-1, 3, 64)[slots[keep]], k[keep])
    untouched = torch.ones(8 * 16, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (kc.view(8 * 16, -1)[untouched] == 0).all(), "a padded (-1) or unused slot was written"


def test_strided_inputs() -> None:
    """K and V as views into a fused qkv tensor (how the model passes them)."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(10, 4 + 2 * 2, 32, generator=g)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.arange(10)
    outs = []
    for fn in (write_kv_cache, write_kv_cache_ref):
        kc, vc = torch.zeros(2, 16, 2, 32, dtype=torch.uint8), torch.zeros(2, 16, 2, 32, dtype=torch.uint8)
        ks, vs = torch.zeros(2, 16, 2, dtype=torch.float16), torch.zeros(2, 16, 2, dtype=torch.float16)
        fn(k, v, kc, vc, slots, ks, vs, "e4m3")
        outs.append((kc, vc, ks, vs))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
