"""Integer weights written as llama.cpp blocks (``kernels.cpu.matmul.int_blocks``) and run on the
block kernels.

The written rows are decoded by the ``gguf`` package (``gguf.quants.dequantize``), an
independent reader of the block formats (qpage's Q8_M by its definition, ``q8m_dequantize``),
and compared with ``dequantize_ref`` of the packed integer tensors: exactly for symmetric
weights (Q4_0, Q8_0), and within the fp16 rounding of the offset ``m`` (2^-11 |m|) for
asymmetric ones (Q4_1: m = -s z; Q8_M: m = -s (z - 128)). The matmul, act-order included, is
held to 1e-2 of the output's norm against the fp32 product with the decoded weight, where one
int8 activation level is the difference, and to 1e-4 for Q8_M, whose activations carry a
second level (as in test_cpu_gguf.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from qpage.kernels.cpu import native as cpu_native  # noqa: E402
from qpage.kernels.cpu.matmul import int_blocks  # noqa: E402
from qpage.kernels.cpu.matmul import native_gguf as ng  # noqa: E402
from qpage.kernels.packing import dequantize_ref, pack_cols, pack_rows  # noqa: E402
from tests.kernels.conftest import rel_err  # noqa: E402
from tests.kernels.gguf_weights import q8m_dequantize  # noqa: E402

CASES = [(4, 128, True, False), (4, 128, False, False), (4, 32, False, True), (4, 0, True, True),
         (8, 0, True, False), (8, 64, True, True), (8, 0, False, False), (8, 32, False, True)]
"""(bits, group size (0: per channel), symmetric, act-order)."""


def weight(bits: int, group: int, sym: bool, act: bool, k: int = 256, n: int = 40, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    gs = group or k
    groups = k // gs
    q = torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.int32)
    z = (torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32) if sym
         else torch.randint(0, 2**bits, (groups, n), generator=g, dtype=torch.int32))
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    g_idx = (torch.randperm(k, generator=g) // gs).int() if act else None
    dense = dequantize_ref(pack_rows(q, bits), s, pack_cols(z, bits), g_idx, bits=bits, group_size=gs, in_features=k)
    return q, s, z, g_idx, gs, dense


@pytest.mark.parametrize(("bits", "group", "sym", "act"), CASES)
def test_rows_decode_to_the_weight(bits: int, group: int, sym: bool, act: bool) -> None:
    q, s, z, g_idx, gs, dense = weight(bits, group, sym, act)
    b = int_blocks.to_block_rows(q, s, z, g_idx, bits, gs)
    want_type = {(4, True): ng.Q4_0, (4, False): ng.Q4_1, (8, True): ng.Q8_0, (8, False): ng.Q8_M}[(bits, sym)]
    assert b.ggml_type == want_type
    assert (b.perm is not None) == (act and group > 0)  # one group per channel needs no order
    got = torch.from_numpy(decode(b).astype(np.float32))
    want = (dense if b.perm is None else dense[b.perm]).t()  # [n, k] in the rows' input order
    if sym:
        assert torch.equal(got, want)
    else:
        grp = g_idx.long() if act else torch.arange(q.shape[0]) // gs
        grp = grp if b.perm is None else grp[b.perm]
        centre = 128 if bits == 8 else 0
        bound = (s.float() * (z.float() - centre).abs())[grp].t() * 2.0**-11
        assert bool(((got - want).abs() <= bound + 1e-7).all())


@pytest.mark.parametrize(("bits", "group", "sym", "act"), CASES)
def test_matmul_runs_the_weight(bits: int, group: int, sym: bool, act: bool) -> None:
    if cpu_native.no_compiler_or_disabled():
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    q, s, z, g_idx, gs, dense = weight(bits, group, sym, act, seed=1)
    b = int_blocks.to_block_rows(q, s, z, g_idx, bits, gs)
    k, n = dense.shape
    mm = ng.PiecewiseMatmul([(0, n, ng.repack(b.rows, b.ggml_type, k))], k, n, input_perm=b.perm)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    decoded = torch.from_numpy(decode(b).astype(np.float32))  # [n, k] in the rows' input order
    assert mm.residual == (b.ggml_type == ng.Q8_M)
    assert rel_err(mm(x), (x if b.perm is None else x[:, b.perm]) @ decoded.t()) < (1e-4 if mm.residual else 1e-2)


def decode(b: int_blocks.BlockRows) -> np.ndarray:
    if b.ggml_type == ng.Q8_M:
        return q8m_dequantize(b.rows)
    return gguf.quants.dequantize(b.rows, gguf.GGMLQuantizationType(b.ggml_type))


def test_reasons() -> None:
    order = torch.arange(256) // 64
    assert int_blocks.int_blocks_reason(4, 64, None, 256) is None
    assert int_blocks.int_blocks_reason(4, 256, order[torch.randperm(256)], 256) is None
    assert int_blocks.int_blocks_reason(8, 64, None, 256) is None
    assert "3-bit" in int_blocks.int_blocks_reason(3, 64, None, 256)
    assert "not whole 32-weight blocks" in int_blocks.int_blocks_reason(4, 48, None, 240)
    assert "not a multiple of 32" in int_blocks.int_blocks_reason(4, 16, None, 256)
    uneven = torch.cat([torch.zeros(40), torch.ones(216)]).int()  # a group of 40 rows
    assert "whole 32-row blocks" in int_blocks.int_blocks_reason(4, 128, uneven, 256)
    q, s, z, g_idx, gs, _ = weight(4, 128, True, False)
    with pytest.raises(ValueError, match="beyond fp16's range"):
        int_blocks.to_block_rows(q, s.float() * 1e8, z, g_idx, 4, gs)
    q, s, z, g_idx, gs, _ = weight(4, 128, False, False)
    with pytest.raises(ValueError, match=r"offsets -s z beyond fp16's range"):  # s < 65504, but s z is not
        int_blocks.to_block_rows(q, torch.full_like(s, 60000.0), z.clamp_min(2), g_idx, 4, gs)
