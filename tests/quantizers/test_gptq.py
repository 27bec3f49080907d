"""GPTQ against RTN on correlated inputs and the act-order grouping (a calibrated act-order
checkpoint of the default model runs in tests/quantizers/test_packed_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from qpage.quantizers.gptq import gptq_quantize
from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 256, generator=g)
    mix = torch.randn(256, 256, generator=g) * 0.3 + torch.eye(256)
    x = (torch.randn(2048, 256, generator=g) @ mix) * torch.linspace(0.2, 3, 256)
    return w, x, 2 * x.T @ x / x.shape[0]


def _dequant(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g_idx: torch.Tensor | None, group: int
             ) -> torch.Tensor:
    grp = g_idx.long() if g_idx is not None else torch.arange(q.shape[0]) // group
    return ((q - z[grp]).float() * s[grp]).t()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output(sym: bool, act_order: bool) -> None:
    w, x, h = _problem()
    ref = x @ w.T

    def err(wq: torch.Tensor) -> float:
        return float((x @ wq.T - ref).norm() / ref.norm())

    rtn = err(dequantize_rtn(*quantize_rtn(w, 4, 64, sym), 64))
    q, s, z, g_idx = gptq_quantize(w, h, 4, 64, sym, act_order=act_order)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and int(z.min()) >= 1
    assert err(_dequant(q, s, z, g_idx, 64)) < 0.9 * rtn
    if act_order:
        assert g_idx is not None and torch.bincount(g_idx.long()).tolist() == [64] * 4
    else:
        assert g_idx is None


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_group_search_lowers_gptq_output_error(sym: bool, act_order: bool) -> None:
    """Group scales from the diag(H)-weighted search (the default) give a lower layer output
    error than the groups' min and max: measured 0.93-0.98x over three seeds and every
    case, asserted below 0.99x on seed 0."""
    w, x, h = _problem()
    ref = x @ w.T
    errs = []
    for search in (False, True):
        q, s, z, g_idx = gptq_quantize(w, h, 4, 64, sym, act_order=act_order, search=search)
        errs.append(float((x @ _dequant(q, s, z, g_idx, 64).T - ref).norm() / ref.norm()))
    assert errs[1] < 0.99 * errs[0], errs
