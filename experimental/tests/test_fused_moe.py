"""The fused-MoE kernel (``experimental/kernels/fused_moe.py``) against plain torch on the same
packed experts, under Triton's interpreter (``TRITON_INTERPRET=1``) or on a GPU.

Run from the repository root: ``TRITON_INTERPRET=1 python -m pytest experimental/tests/test_fused_moe.py``.
Tolerance: fp32 activations, the kernel's ieee dots against fp32 matmuls over the same
dequantized weights: summation order only, 1e-4 of the output's largest value.
"""

from __future__ import annotations

import pytest
import torch

from experimental.kernels.fused_moe import PackedExperts, align_by_expert, fused_moe, fused_moe_ref
from qpage.kernels.packing import pack_cols, pack_rows
from qpage.kernels.triton_utils import INTERPRET

pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="needs TRITON_INTERPRET=1 or a CUDA device")


def packed_experts(g: torch.Generator, experts: int, k: int, n: int, bits: int, group: int, zeros: bool
                   ) -> PackedExperts:
    q = torch.randint(0, 1 << bits, (experts, k, n), generator=g, dtype=torch.int32)
    s = torch.rand(experts, k // group, n, generator=g) * 0.02 + 0.005
    z = torch.randint(0, 1 << bits, (experts, k // group, n), generator=g, dtype=torch.int32)
    return (torch.stack([pack_rows(q[e], bits) for e in range(experts)]), s,
            torch.stack([pack_cols(z[e], bits) for e in range(experts)]) if zeros else None)


def test_align_by_expert_pads_each_run() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    slots, tiles = align_by_expert(ids, 4, 4)
    assert tiles.tolist() == [0, 1, 2]  # expert 3 has no rows: no tile
    pad = ids.numel()
    assert slots.tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]


@pytest.mark.parametrize(("bits", "zeros", "tokens"), [(4, True, 7), (4, False, 1), (8, True, 20)])
def test_fused_moe_matches_torch(bits: int, zeros: bool, tokens: int) -> None:
    g = torch.Generator().manual_seed(bits + tokens)
    experts, top_k, hidden, inter, group = 4, 2, 64, 32, 32
    gate_up = packed_experts(g, experts, hidden, 2 * inter, bits, group, zeros)
    down = packed_experts(g, experts, inter, hidden, bits, group, zeros)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    got = fused_moe(x, ids, weights, gate_up, down, bits=bits, group_size=group, block_m=16)
    want = fused_moe_ref(x, ids, weights, gate_up, down, bits=bits, group_size=group)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
