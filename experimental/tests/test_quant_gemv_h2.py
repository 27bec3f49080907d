"""The half2 INT4/INT8 GEMV (``quant_gemv_h2``): its PTX, run by a numpy model of the instructions,
against exact sums; the kernel (the interpreter runs the same arithmetic as Triton fp16
operations) against the reference; and where it does not apply, the other kernels.

Tolerances: a word's 8 products and their sum are rounded to fp16, so each word's sum is
within 5 fp16 roundings (2**-11 relative each) of its exact value, bounded here by
6 * 2**-11 * sum |terms|. Whole GEMVs: ||out - ref|| / ||ref|| within the tolerances of
``test_quant_matmul``, 2e-3 for fp16 and 1e-2 for bf16 (the output's rounding; fp16 measured
3.5-6.1e-4 here, against 0-4.9e-5 for the fp32-accumulating GEMV, whose output rounds like
the reference's). Against ``h2_gemv_ref``, the same arithmetic in torch: one output rounding
step at most (the fp32 order of the words' sums differs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qpage.kernels.quant_gemv_h2 import PAIR_PTX, WORD_SUMS8_PTX, WORD_SUMS_PTX, h2_gemv_ref
from qpage.kernels.quant_matmul import MatmulConfig
from tests.kernels.ptx_model import run_ptx

from qpage.kernels import quant_gemv_h2
from tests.kernels.conftest import rel_err, spy
from tests.kernels.test_quant_matmul import TOL, make_weight, run


def _f16_bits(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint16).astype(np.uint32)


def test_ptx_model_instructions() -> None:
    """The model itself, on values worked by hand: LOP3 lookup tables, the fp16x2 lanes,
    fused rounding, and the conversions' operand order."""
    a, b, c = np.uint32(0xF0F0_1234), np.uint32(0x0F0F_00FF), np.uint32(0x6400_6400)
    got = run_ptx("lop3.b32 $0, $1, $2, $3, 0xEA; lop3.b32 $4, $1, $2, $3, 0x96;", {1: a, 2: b, 3: c})
    assert got[0] == (a & b) | c and got[4] == a ^ b ^ c
    one_two = _f16_bits(np.array(1.0)) | (_f16_bits(np.array(2.0)) << 16)
    three = _f16_bits(np.array(3.0)) * 0x10001
    got = run_ptx("fma.rn.f16x2 $0, $1, $2, $1; sub.rn.f16x2 $3, $1, $2;", {1: one_two, 2: three})
    assert got[0] == _f16_bits(np.array(4.0)) | (_f16_bits(np.array(8.0)) << 16)
    assert got[3] == _f16_bits(np.array(-2.0)) | (_f16_bits(np.array(-1.0)) << 16)
    # fma rounds once: 1025 * 3 - 3074 is 1 fused; rounding 3075 to fp16 first (3076) would give 2.
    a = _f16_bits(np.array(1025.0)) * 0x10001
    b = _f16_bits(np.array(3.0)) * 0x10001
    c = _f16_bits(np.array(-3074.0)) * 0x10001
    assert run_ptx("fma.rn.f16x2 $0, $1, $2, $3;", {1: a, 2: b, 3: c})[0] == _f16_bits(np.array(1.0)) * 0x10001
    assert run_ptx("mul.rn.f16x2 $0, $1, $2;", {1: a, 2: b})[0] == _f16_bits(np.array(3076.0)) * 0x10001
    packed = run_ptx(PAIR_PTX.value, {1: np.float32(1.5), 2: np.float32(-3.0)})[0]
    assert packed == _f16_bits(np.array(1.5)) | (_f16_bits(np.array(-3.0)) << 16)
    with pytest.raises(NotImplementedError, match=r"add\.f32"):
        run_ptx("add.f32 $0, $1, $1;", {1: np.float32(1.0)})


@pytest.mark.parametrize("bits", [4, 8])
def test_word_sums_ptx_against_exact_sums(bits: int) -> None:
    """``WORD_SUMS_PTX`` (4 bits) and ``WORD_SUMS8_PTX`` (8 bits) on 20k random words: each
    result is the exact sum over the word's values of (q_j - z) * x_j (x_j as the fp16 the
    kernel passes) within 6 fp16 roundings of the terms' magnitude; all zeros of the width,
    activations in [-2, 2) as the kernel scales them, including exact zeros and fp16
    subnormals."""
    pack = 32 // bits
    rng = np.random.default_rng(bits)
    n = 20000
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    z = rng.integers(0, 2**bits, n).astype(np.uint32)
    x = rng.uniform(-2, 2, (n, pack)).astype(np.float32)
    x[::7, 3] = 0.0
    x[::11, pack - 1] = np.float32(3e-6)  # an fp16 subnormal
    x16 = x.astype(np.float16).astype(np.float64)
    half = pack // 2
    pairs = [run_ptx(PAIR_PTX.value, {1: x[:, j], 2: x[:, j + half]})[0] for j in range(half)]
    z_even = ((0x6400 + z) * 0x10001).astype(np.uint32)
    if bits == 4:
        z_odd = ((0xD400 + (z << 4)) * 0x10001).astype(np.uint32)
        got = run_ptx(WORD_SUMS_PTX.value, {1: words, 2: z_even, 3: z_odd, 4: pairs[0], 5: pairs[1], 6: pairs[2],
                                            7: pairs[3]})[0]
    else:
        got = run_ptx(WORD_SUMS8_PTX.value, {1: words, 2: z_even, 3: pairs[0], 4: pairs[1]})[0]
    q = (words[:, None] >> (bits * np.arange(pack, dtype=np.uint32))[None, :]) & ((1 << bits) - 1)
    terms = (q.astype(np.float64) - z[:, None]) * x16
    exact = terms.sum(axis=1)
    bound = 6 * 2.0**-11 * np.abs(terms).sum(axis=1) + 2.0**-24
    assert got.dtype == np.float32
    assert (np.abs(got - exact) <= bound).all(), float(np.max(np.abs(got - exact) / bound))
    assert np.abs(got - exact).max() > 0  # it does round in fp16 (the bound is not vacuous)
    # And bit for bit the arithmetic that h2_gemv_ref and the interpreter's path do: per lane
    # (the first and the second half of the values) one rounded product, then fused
    # multiply-adds, then the lanes' fp16 sum.
    lanes = []
    for first in (0, half):
        acc = terms[:, first].astype(np.float16).astype(np.float64)
        for j in range(first + 1, first + half):
            acc = (acc + terms[:, j]).astype(np.float16).astype(np.float64)
        lanes.append(acc)
    np.testing.assert_array_equal(got, (lanes[0] + lanes[1]).astype(np.float16).astype(np.float32))


@pytest.fixture
def h2_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each GEMV ``int_matmul`` launches takes the half2 kernel (``int_gemv`` does
    exactly when ``h2_applies`` says so)."""
    return spy(monkeypatch, quant_gemv_h2, "h2_applies")


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("scale", [1.0, 3000.0, 1e-4], ids=["unit", "large", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_h2_gemv_matches_ref(bits: int, sym: bool, scale: float, dtype: torch.dtype, h2_calls: list[bool]) -> None:
    """M = 1, K = 324 (a half-filled last word and a short last tile), N = 96 (a partial column
    tile), groups of 64 with 64-row tiles and per-channel with 128-row tiles; K unsplit, split
    serially in 2 and atomically in 3. Activations of unit size, large (|x| to 3e4 with 4-bit
    weights, 1e3 with 8-bit ones: an unscaled fp16 product (q - z) * x would overflow, the
    output not) and tiny (1e-4: fp16 subnormals without the per-word scaling), in fp16 and
    bf16; 4- and 8-bit weights."""
    weights = (make_weight(324, 96, bits, 64, sym=sym, seed=3), make_weight(384, 64, bits, 384, sym=sym, seed=5))
    for w in weights:
        k = w["q"].shape[0]
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)) * (scale if bits == 4 or scale < 2 else 30.0)
        x[0, 5] *= 10
        x = x.to(dtype)
        assert torch.isfinite(x).all()
        bk = 64 if w["group"] == 64 else 128
        for cfg in (MatmulConfig(16, 64, bk, gemv=True, half2=True),
                    MatmulConfig(16, 32, bk, split_k=2, gemv=True, half2=True),
                    MatmulConfig(16, 64, bk, split_k=3, serial=False, gemv=True, half2=True)):
            out, ref = run(x, w, cfg)
            assert out.shape == ref.shape and out.dtype == dtype
            assert rel_err(out, ref) < TOL[dtype], cfg
            # The same arithmetic in torch (h2_gemv_ref): equal but for the fp32 order of the
            # words' sums, at most one rounding step of the output apart.
            same = h2_gemv_ref(x, w["qweight"], w["scales"], w["qzeros"], group_size=w["group"], bits=bits)
            assert torch.allclose(out.float(), same.float(), rtol=2.0**-7 if dtype == torch.bfloat16 else 2.0**-10,
                                  atol=0), cfg
    assert h2_calls == [True] * 6


@pytest.mark.parametrize(("awq", "bits", "dtype"), [
    (False, 4, torch.float32), (True, 4, torch.float16), (False, 8, torch.float32)], ids=["fp32", "awq", "int8-fp32"])
def test_h2_falls_back_where_it_does_not_apply(awq: bool, bits: int, dtype: torch.dtype,
                                               h2_calls: list[bool]) -> None:
    """``half2`` on fp32 activations or AWQ weights runs the other GEMV."""
    w = make_weight(256, 64, bits, 64, awq=awq, seed=6)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(7)).to(dtype)
    out, ref = run(x, w, MatmulConfig(16, 64, 64, split_k=2, gemv=True, half2=True))
    assert rel_err(out, ref) < TOL[dtype]
    assert h2_calls == [False]


def test_half2_switch_on_the_gpu_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (faked: SM count and an empty tuned table) the GEMV stays in fp32 unless
    ``QPAGE_GEMV_HALF2=1``; ``0`` turns it off again, and neither touches non-GEMV tiles."""
    from types import SimpleNamespace

    from qpage.kernels import quant_matmul, tuned

    monkeypatch.setattr(quant_matmul, "INTERPRET", False)
    monkeypatch.setitem(tuned._INSTALLED, "cuda", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=128))
    cuda = torch.device("cuda")
    try:
        for env, want in ((None, False), ("1", True), ("0", False)):
            if env is None:
                monkeypatch.delenv("QPAGE_GEMV_HALF2", raising=False)
            else:
                monkeypatch.setenv("QPAGE_GEMV_HALF2", env)
            quant_matmul.choose_config.cache_clear()
            gemv = quant_matmul.choose_config(cuda, "int4-g128", 1, 14336, 4096, 128)
            assert gemv.gemv and gemv.half2 is want, (env, gemv)
            assert not quant_matmul.choose_config(cuda, "int4-g128", 8, 14336, 4096, 128).half2
    finally:
        quant_matmul.choose_config.cache_clear()
