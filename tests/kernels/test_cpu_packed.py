"""torch's packed CPU kernels (``kernels.cpu.matmul.packed``) against the dequantized reference.

qpage uses them with bf16 activations only (fp16 is exact too, but slow on CPU).
The layers hold GPTQ-layout weights; ``pack_int4``/``pack_int8`` convert them once. The
reference is ``x @ dequantize_ref(...)`` in fp32 on the same (rounded) activations.
Tolerances, ||out - ref|| / ||ref||: bf16 1e-2, fp16 2e-3 (the output dtype's rounding and
the scale/zero pair stored in the activation dtype; accumulation is fp32).
"""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.cpu.matmul import packed as cpu_packed
from qpage.kernels.packing import dequantize_ref, pack_cols, pack_rows
from tests.kernels.conftest import rel_err

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def weight(k: int, n: int, bits: int, group: int, *, sym: bool, act_order: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    z = torch.full((groups, n), 1 << (bits - 1)) if sym else torch.randint(0, 2**bits, (groups, n), generator=g)
    g_idx = (torch.randperm(k, generator=g) // group).int() if act_order else None
    return dict(q=torch.randint(0, 2**bits, (k, n), generator=g), z=z, g_idx=g_idx,
                s=(torch.rand(groups, n, generator=g) * 0.02 + 0.002).half(), group=group, bits=bits)


def reference(x: torch.Tensor, w: dict) -> torch.Tensor:
    k = w["q"].shape[0]
    dense = dequantize_ref(pack_rows(w["q"], w["bits"]), w["s"], pack_cols(w["z"], w["bits"]), w["g_idx"],
                           bits=w["bits"], group_size=w["group"], in_features=k)
    return x.float() @ dense


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "group", "sym", "act_order"), [
    (576, 128, False, False),  # the default model's K: a partial last group, padded
    (576, 128, True, True),    # act-order: rows regrouped, activations permuted
    (512, 64, False, True),
    (256, 32, True, False),
])
@pytest.mark.parametrize("m", [1, 5])
def test_int4(dtype: torch.dtype, k: int, group: int, sym: bool, act_order: bool, m: int) -> None:
    w = weight(k, 96, 4, group, sym=sym, act_order=act_order)
    assert cpu_packed.packed_reason(4, group, w["g_idx"], k, 96, torch.bfloat16) is None
    p = cpu_packed.pack_int4(w["q"], w["s"], w["z"], w["g_idx"], group, dtype)
    assert p.pad == (-k) % group and (p.perm is not None) == act_order
    x = torch.randn(m, k).to(dtype)
    out = cpu_packed.int4_mm(x, p)
    assert out.dtype == dtype and out.shape == (m, 96)
    assert rel_err(out, reference(x, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sym", [True, False])
def test_int8_per_channel(dtype: torch.dtype, sym: bool) -> None:
    k = 576
    w = weight(k, 80, 8, k, sym=sym, act_order=False)
    p = cpu_packed.pack_int8(w["q"], w["s"], w["z"], dtype)
    assert (p.offset is None) == sym
    x = torch.randn(3, k).to(dtype)
    assert rel_err(cpu_packed.int8_mm(x, p), reference(x, w)) < TOL[dtype]


def test_reasons() -> None:
    """Where the packed kernels do not fit, the reason names the limit (the layer then dequantizes)."""
    assert "float32" in cpu_packed.packed_reason(4, 128, None, 576, 96, torch.float32)
    assert "float16" in cpu_packed.packed_reason(4, 128, None, 576, 96, torch.float16)  # correct but slow
    assert "group size 16" in cpu_packed.packed_reason(4, 16, None, 576, 96, torch.bfloat16)
    assert "multiple of 16" in cpu_packed.packed_reason(4, 128, None, 576, 100, torch.bfloat16)
    assert "per channel" in cpu_packed.packed_reason(8, 128, None, 576, 96, torch.bfloat16)
    uneven = torch.tensor([0] * 100 + [1] * 28, dtype=torch.int32)  # 100 rows in group 0 of 64
    assert "equal groups" in cpu_packed.packed_reason(4, 64, uneven, 128, 96, torch.bfloat16)
