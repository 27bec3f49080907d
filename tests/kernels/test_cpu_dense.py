"""The C dense fp32 matmul (``kernels.cpu.matmul.dense``) against an fp64 reference, and its
batch invariance.

Tolerance: each output is one chain of k multiply-adds, each rounded once, so its error is
at most gamma_k = k u / (1 - k u) (u = 2^-24) times sum_i |x_i w_i| (Higham, Accuracy and
Stability of Numerical Algorithms, 3.1); the test holds every element to that bound.
Invariance is exact: a row's bits do not depend on the call it is in.
"""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.cpu import native as cpu_native
from qpage.kernels.cpu.matmul.dense import DensePanels, unsupported_reason

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

U = 2.0**-24


def within_chain_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    k = x.shape[1]
    ref = x.double() @ w.double().t()
    bound = k * U / (1 - k * U) * (x.double().abs() @ w.double().abs().t())
    return bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 16), (3, 37, 5), (9, 100, 64), (17, 33, 300), (40, 257, 129)])
def test_matches_fp64_within_the_chain_bound(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out = DensePanels(w)(x)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert within_chain_bound(out, x, w)


def test_rows_do_not_depend_on_the_call() -> None:
    """Every row of an m-row call equals the same row computed alone, bit for bit, for every m
    across the row tiles and every thread count; a transposed view packs to the same panels."""
    g = torch.Generator().manual_seed(0)
    n, k = 200, 96  # 13 panels: whole tiles and a single leftover panel
    x, w = torch.randn(21, k, generator=g), torch.randn(n, k, generator=g)
    panels = DensePanels(w, threads=2)
    alone = torch.cat([panels(x[r : r + 1]) for r in range(x.shape[0])])
    for m in range(1, x.shape[0] + 1):
        for start in (0, x.shape[0] - m):
            assert torch.equal(panels(x[start : start + m]), alone[start : start + m]), (m, start)
    assert torch.equal(DensePanels(w, threads=1)(x), alone)
    assert torch.equal(DensePanels(w.t().contiguous().t())(x), alone)
    assert torch.equal(panels(x.view(3, 7, k)).view(21, n), alone)  # leading dims flattened
    assert torch.equal(panels(x.double()), alone)  # other dtypes are converted to fp32 first


def test_writes_a_column_slice_and_reads_strided_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 2 * 48, generator=g)[:, ::1][:, :48], torch.randn(20, 48, generator=g)
    assert x.stride(0) == 96
    out = torch.full((6, 30), 7.0)
    panels = DensePanels(w)
    panels.into(x, out[:, 5:25])
    assert torch.equal(out[:, 5:25], panels(x.contiguous()))
    assert (out[:, :5] == 7).all() and (out[:, 25:] == 7).all()
    with pytest.raises(ValueError, match="do not fit"):
        panels.into(x, out[:, :10].t())


def test_says_why_it_cannot_run() -> None:
    assert unsupported_reason(torch.float32, torch.device("cpu")) is None
    assert "fp32" in str(unsupported_reason(torch.bfloat16, torch.device("cpu")))
    assert "cpu" in str(unsupported_reason(torch.float32, torch.device("meta")))
