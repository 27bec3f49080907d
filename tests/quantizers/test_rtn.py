"""RTN quantization: reconstruction bounds, ranges, and the zero >= 1 rule GPTQ v1 needs."""

from __future__ import annotations

import pytest
import torch

from qpage.formats.scheme import QuantScheme
from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, None])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_is_at_most_half_a_step(bits: int, group: int | None, sym: bool) -> None:
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(0))
    q, scale, zero = quantize_rtn(w, bits, group, sym)
    assert q.shape == (200, 48) and int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1
    assert int(zero.min()) >= 1, "GPTQ v1 stores zero - 1: zeros must be >= 1"
    if sym:
        assert (zero == 2 ** (bits - 1)).all()
    d = dequantize_rtn(q, scale, zero, group)
    grp = torch.arange(200) // (group or 200)
    step = scale[grp].t()  # [out, in]
    err = (d - w).abs()
    # Rounding: half a step. Only the group's extremes can be clipped (the symmetric grid's
    # top is 2**(b-1) - 1 steps; an asymmetric zero and a maximum that both round up
    # overflow the top code), by at most one step more.
    assert (err <= step / 2 + 1e-6).float().mean() > 0.99
    assert (err <= step * 1.5 + 1e-6).all()


def test_scheme_parsing_and_errors() -> None:
    s = QuantScheme.parse("int4-rtn", group_size=64, sym=False)
    assert (s.bits, s.group_size, s.sym, s.method) == (4, 64, False, "rtn")
    assert s.bits_per_weight(576) == pytest.approx(4 + 20 / 64)
    with pytest.raises(ValueError, match="scheme 'int3-awq' is not supported yet"):
        QuantScheme.parse("int3-awq")
    fp8 = QuantScheme.parse("fp8-block")
    assert fp8.is_fp8 and fp8.block == 128 and fp8.bits_per_weight(576) == pytest.approx(8 + 32 / 128**2)
    with pytest.raises(ValueError, match="fp8 has no act-order"):
        QuantScheme.parse("fp8", act_order=True)
    assert QuantScheme.parse("int4-gptq", act_order=True).act_order
    with pytest.raises(ValueError, match="group_size=100"):
        QuantScheme(4, 100, True)
    with pytest.raises(ValueError, match="act_order needs GPTQ"):
        QuantScheme(4, 128, True, act_order=True)
