"""Block encoders of ``qpage quantize --format gguf``: bytes decoded by the ``gguf`` package's
reference dequantization (ggml's layouts, written independently of ours) give back weights
that lie on a format's grid exactly, and on random weights the weighted error is below the
plain reference rounding of the ``gguf`` package (llama.cpp's ``quantize_row_*_ref``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from qpage.quantizers import ggml_blocks as gb

TYPES = sorted(gb.GRIDS)


def on_grid(ggml_type: int, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights every format of that type holds exactly: fp16 scales, integer codes covering
    each sub-block's whole range (so the plain grid is the exact one), and for K-quants
    sub-block integers reaching the top of their range in every super-block."""
    g = gb.GRIDS[ggml_type]
    gen = torch.Generator().manual_seed(seed)
    nsub = rows * k // g.sub
    q = torch.randint(g.lo, g.hi + 1, (nsub, g.sub), generator=gen).float()
    q[:, 0], q[:, 1] = g.lo, g.hi  # the whole range in every sub-block
    d = (torch.rand(nsub // (g.block // g.sub), generator=gen) * 0.01 + 0.001).half().float()
    per = g.block // g.sub
    if g.block == g.sub:
        s = d
        m = -(torch.rand(nsub, generator=gen) * 0.05).half().float() if g.offset else torch.zeros(nsub)
    else:
        top = 63 if g.offset else 127
        sc = torch.randint(1, top + 1, (nsub // per, per), generator=gen).float()
        sc[:, 0] = top
        if not g.offset:
            sc = sc * torch.where(torch.rand(sc.shape, generator=gen) < 0.5, -1.0, 1.0)
            sc[:, 0] = top
        s = (d[:, None] * sc).reshape(-1)
        if g.offset:
            dmin = (torch.rand(nsub // per, generator=gen) * 0.01 + 0.001).half().float()
            mc = torch.randint(0, 64, (nsub // per, per), generator=gen).float()
            mc[:, 0] = 63
            m = -(dmin[:, None] * mc).reshape(-1)
        else:
            m = torch.zeros(nsub)
    return (q * s[:, None] + m[:, None]).reshape(rows, k)


@pytest.mark.parametrize("ggml_type", TYPES, ids=[T(t).name for t in TYPES])
def test_weights_on_the_grid_come_back_exactly(ggml_type: int) -> None:
    w = on_grid(ggml_type, 8, 512)
    blocks = gb.quantize_rows(w, ggml_type)
    assert blocks.shape == (8, 512 // gb.GRIDS[ggml_type].block * gb.GRIDS[ggml_type].nbytes)
    back = dequantize(blocks, T(ggml_type))
    np.testing.assert_allclose(back, w.numpy(), rtol=0, atol=1e-6 * float(w.abs().max()))


@pytest.mark.parametrize("weighted", [False, True], ids=["magnitude", "importance"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=[T(t).name for t in TYPES])
def test_weighted_error_below_plain_rounding(ggml_type: int, weighted: bool) -> None:
    """The search never loses to the plain grid on the weighted error it minimises; K-quants
    (whose sub-block scales are stored in 6 or 8 bits) against the plain rounding of the
    32-weight type with the same codes and fp16 scales per 32 weights."""
    torch.manual_seed(1)
    w = torch.randn(64, 512) * 0.02
    w[5, 17] = 0.5  # an outlier, as real weights have
    imp = torch.rand(512) ** 4 if weighted else None
    wt = (imp if imp is not None else torch.ones(512)).numpy()
    ours = dequantize(gb.quantize_rows(w, ggml_type, imp), T(ggml_type))
    plain_type = {gb.Q4_K: gb.Q4_1, gb.Q5_K: gb.Q5_1, gb.Q6_K: gb.Q8_0}.get(ggml_type, ggml_type)
    plain = dequantize(quantize(w.numpy(), T(plain_type)), T(plain_type))

    def err(x: np.ndarray) -> float:
        return float(((x - w.numpy()) ** 2 * wt).sum())

    if ggml_type == gb.Q6_K:  # 6 bits against Q8_0's 8: only ask for the same order
        assert err(ours) < 20 * err(plain)
    else:
        assert err(ours) < (0.9 if weighted else 1.0) * err(plain), (err(ours), err(plain))


def test_unsupported_rows_and_types_are_named() -> None:
    assert gb.unsupported_reason(gb.Q4_K, 576) == "rows of 576 weights are not whole 256-weight Q4_K blocks"
    assert gb.unsupported_reason(gb.Q4_0, 576) is None
    assert "not written by qpage" in str(gb.unsupported_reason(int(T.IQ4_XS), 256))
    with pytest.raises(ValueError, match="not whole 32-weight Q8_0 blocks"):
        gb.quantize_rows(torch.zeros(2, 48), gb.Q8_0)


def test_zero_and_constant_blocks() -> None:
    """All-zero blocks (pruned rows, padding) encode as zeros, not NaN."""
    w = torch.zeros(4, 256)
    w[1] = 0.25
    for t in TYPES:
        back = dequantize(gb.quantize_rows(w, t), T(t))
        assert np.isfinite(back).all(), T(t).name
        np.testing.assert_allclose(back[0], 0, atol=0)
        np.testing.assert_allclose(back[1], 0.25, rtol=2e-3, atol=0)
