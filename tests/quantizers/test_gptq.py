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


@pytest.mark.parametrize("ggml_type", [2, 3, 8, 12, 13, 14], ids=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gptq_in_block_formats_beats_weighted_rounding(ggml_type: int) -> None:
    """GPTQ into a llama.cpp block type: the bytes decode (``gguf``'s reference) to a weight
    whose layer output error on the calibration inputs is below importance-weighted rounding
    into the same type."""
    from gguf.quants import dequantize

    from qpage.quantizers.ggml_blocks import quantize_rows
    from qpage.quantizers.gptq import gptq_ggml

    w, x, h = _problem()
    ref = x @ w.T

    def out_err(blocks: object) -> float:
        wq = torch.from_numpy(dequantize(blocks, ggml_type).astype("float32"))
        assert wq.shape == w.shape
        return float((x @ wq.T - ref).square().mean())

    rounded = out_err(quantize_rows(w, ggml_type, torch.diag(h)))
    gptq = out_err(gptq_ggml(w, h, ggml_type))
    assert gptq < rounded, (gptq, rounded)
