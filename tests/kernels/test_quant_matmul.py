"""INT4/INT8 dequant-matmul (GPTQ and AWQ layouts; tl.dot and GEMV kernels) against the torch reference.

Tolerances, ||out - ref|| / ||ref|| against ``int_matmul_ref`` on the same packed weights
(fp32 math, output cast to the activation dtype): fp32 1e-5, fp16 2e-3, bf16 1e-2 (the
output dtype's rounding; accumulation is fp32 in both).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qpage.kernels.quant_matmul import (
    MatmulConfig,
    dequantize_ref,
    int_matmul,
    int_matmul_ref,
    pack_cols,
    pack_rows,
    unpack_cols,
    unpack_rows,
)
from tests.kernels.conftest import rel_err, spy

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_weight(k: int, n: int, bits: int, group: int, *, awq: bool = False, sym: bool = False,
                act_order: bool = False, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (k, n), generator=g)
    z = torch.randint(0, 2**bits, (groups, n), generator=g)
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    g_idx = (torch.randperm(k, generator=g) // group).int() if act_order else None
    return dict(q=q, z=None if sym else z, scales=s, g_idx=g_idx, bits=bits, group=group, awq=awq,
                qweight=pack_cols(q, bits, awq=True) if awq else pack_rows(q, bits),
                qzeros=None if sym else pack_cols(z, bits, awq=awq))


def run(x: torch.Tensor, w: dict, config: MatmulConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    args = (w["qweight"], w["scales"], w["qzeros"], w["g_idx"])
    kw = dict(bits=w["bits"], group_size=w["group"], awq=w["awq"])
    return int_matmul(x, *args, config=config, **kw), int_matmul_ref(x, *args, **kw)


def test_packing_layouts() -> None:
    """Nibble order by hand: GPTQ plain (value j in bits 4j), AWQ interleaved 0,2,4,6,1,3,5,7."""
    vals = torch.arange(8)[None, :]
    assert pack_cols(vals, 4).item() == 0x76543210
    assert pack_cols(vals, 4, awq=True).item() == 0x75316420
    assert pack_rows(vals.T, 4).item() == 0x76543210
    assert pack_cols(torch.tensor([[0x12, 0xFF, 0x00, 0x80]]), 8).item() == (0x8000FF12 - 2**32)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (40, 24), generator=g)
    assert torch.equal(unpack_rows(pack_rows(q, 4), 4, 40), q)
    assert torch.equal(unpack_cols(pack_cols(q, 4, awq=True), 4, 24, awq=True), q)
    q8 = torch.randint(0, 256, (12, 8), generator=g)
    assert torch.equal(unpack_rows(pack_rows(q8, 8), 8, 12), q8)


@pytest.mark.parametrize(("awq", "act_order"), [(False, False), (False, True), (True, False)],
                         ids=["gptq", "gptq-actorder", "awq"])
def test_dequantize_ref_formula(awq: bool, act_order: bool) -> None:
    """W[k, n] = scales[g(k), n] * (q[k, n] - z[g(k), n]) with g from g_idx or k // group."""
    w = make_weight(96, 40, 4, 32, awq=awq, act_order=act_order)
    grp = w["g_idx"].long() if act_order else torch.arange(96) // 32
    want = (w["q"] - w["z"][grp]).float() * w["scales"].float()[grp]
    got = dequantize_ref(w["qweight"], w["scales"], w["qzeros"], w["g_idx"], bits=4, group_size=32,
                         in_features=96, awq=awq)
    assert torch.equal(got, want)


CASES = [
    # (M, K, N, bits, group, awq, sym, act_order)
    (1, 256, 128, 4, 128, False, True, False),
    (3, 256, 96, 4, 64, False, False, False),
    (16, 256, 128, 4, 32, False, False, True),
    (5, 192, 64, 4, 128, False, False, False),  # K=192: partial last group of 128
    (7, 256, 128, 4, 128, True, False, False),  # AWQ
    (1, 256, 64, 4, 64, True, True, False),  # AWQ symmetric
    (33, 128, 64, 8, 128, False, True, False),  # INT8 per-channel (one group = K)
    (2, 128, 64, 8, 32, False, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}_K{}_N{}_b{}_g{}{}{}{}".format(
    *c[:5], "_awq" if c[5] else "", "_sym" if c[6] else "", "_actorder" if c[7] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int_matmul_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    m, k, n, bits, group, awq, sym, act = case
    w = make_weight(k, n, bits, group, awq=awq, sym=sym, act_order=act)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    out, ref = run(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize(("awq", "bits"), [(False, 4), (True, 4), (False, 8)], ids=["gptq4", "awq4", "gptq8"])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gemv_and_split_k(awq: bool, sym: bool, bits: int, dtype: torch.dtype) -> None:
    """M=1 through the GEMV kernels (GPTQ: in-place and shift unpacking; split K in 2 and 3)
    and the tl.dot kernel with split K, each with the serial (last program sums) and the
    atomic reduction. K = 324 ends in a half-filled word and a short last tile; N = 96 a
    partial column tile."""
    w = make_weight(324, 96, bits, 64, awq=awq, sym=sym, seed=3)
    x = torch.randn(1, 324, generator=torch.Generator().manual_seed(4)).to(dtype)
    for serial in (True, False):
        for lean in ((True, False) if not awq else (True,)):
            for cfg in (MatmulConfig(16, 32, 64, split_k=2, gemv=True, serial=serial, lean=lean),
                        MatmulConfig(16, 64, 64, split_k=3, gemv=True, serial=serial, lean=lean),
                        MatmulConfig(16, 32, 32, split_k=4, serial=serial)):
                out, ref = run(x, w, cfg)
                assert out.dtype == dtype
                assert rel_err(out, ref) < TOL[dtype], cfg


@pytest.mark.parametrize("kernel", ["gemv", "dot", "fp8"])
def test_serial_split_k_is_deterministic_and_resets_its_counters(kernel: str) -> None:
    """The serial reduction sums the partials in a fixed order (two calls give the same bits,
    equal to the unsplit kernel's within fp32 rounding) and leaves every counter at zero, so
    the next launch (another shape, another grid) starts clean."""
    from qpage.kernels.fp8_matmul import fp8_matmul
    from qpage.kernels.split_k import _LOCKS

    w = make_weight(512, 192, 4, 64, seed=5)
    x = torch.randn(3 if kernel != "gemv" else 1, 512, generator=torch.Generator().manual_seed(6))
    f8 = (torch.randn(192, 512, generator=torch.Generator().manual_seed(7)) * 50).to(torch.float8_e4m3fn)
    s8 = torch.rand(192) * 0.01

    def call(split: int) -> torch.Tensor:
        cfg = MatmulConfig(16, 64, 64, split_k=split, gemv=kernel == "gemv")
        return fp8_matmul(x, f8, s8, cfg) if kernel == "fp8" else run(x, w, cfg)[0]

    a, b, whole = call(4), call(4), call(1)
    assert torch.equal(a, b)
    assert rel_err(a, whole) < 1e-6
    assert int(_LOCKS[x.device].abs().sum()) == 0


def test_split_k_atomic_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """QPAGE_SPLIT_K=atomic turns a serial config into the atomic scheme: same result up to
    summation order, and the serial path's counters are never touched."""
    from qpage.kernels import split_k

    w = make_weight(512, 192, 4, 64, seed=5)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6))
    cfg = MatmulConfig(16, 64, 64, split_k=4, gemv=True)
    serial = run(x, w, cfg)[0]
    sentinel = torch.full((4096,), 7, dtype=torch.int32)
    monkeypatch.setitem(split_k._LOCKS, x.device, sentinel)
    monkeypatch.setenv("QPAGE_SPLIT_K", "atomic")
    out, ref = run(x, w, cfg)
    assert rel_err(out, ref) < TOL[torch.float32] and rel_err(out, serial) < 1e-6
    assert bool((sentinel == 7).all())  # a serial launch would have found 7s and mis-summed


@pytest.mark.parametrize(("awq", "act_order", "bits", "sym"),
                         [(False, False, 4, False), (False, True, 4, False), (True, False, 4, False),
                          (True, False, 4, True), (False, False, 8, True)],
                         ids=["gptq", "gptq-actorder", "awq", "awq-sym", "int8"])
def test_gather_unpack_and_dequant_paths(awq: bool, act_order: bool, bits: int, sym: bool) -> None:
    """The gather unpack (tl.dot path) and the dequantize-then-matmul path (prefill-sized M),
    whose dense weight equals ``dequantize_ref`` bit for bit in fp32, built in column chunks."""
    from qpage.kernels.quant_dequant import dequant_matmul, dequantize_int

    k, n = 256, 200
    w = make_weight(k, n, bits, 64, awq=awq, sym=sym, act_order=act_order, seed=8)
    args = (w["qweight"], w["scales"], w["qzeros"], w["g_idx"])
    dense = dequantize_int(*args, bits=bits, group_size=64, in_features=k, awq=awq, dtype=torch.float32)
    assert torch.equal(dense, dequantize_ref(*args, bits=bits, group_size=64, in_features=k, awq=awq))
    part = dequantize_int(*args, bits=bits, group_size=64, in_features=k, awq=awq, dtype=torch.float32,
                          columns=(64, 136))
    assert torch.equal(part, dense[:, 64:136])
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(9))
    ref = int_matmul_ref(x, *args, bits=bits, group_size=64, awq=awq)
    for cfg in (MatmulConfig(16, 64, 32, gather=True), MatmulConfig(16, 64, 64, split_k=2, gather=True),
                MatmulConfig(128, 128, 64, dequant=True)):
        assert rel_err(run(x, w, cfg)[0], ref) < TOL[torch.float32], cfg
    chunked = dequant_matmul(x, *args, bits=bits, group_size=64, awq=awq, max_chunk_bytes=k * 4 * 128)
    assert rel_err(chunked, ref) < TOL[torch.float32]


def test_rejects_unsupported_bits() -> None:
    w = make_weight(64, 32, 4, 32)
    with pytest.raises(ValueError, match="bits=3"):
        int_matmul(torch.randn(1, 64), w["qweight"], w["scales"], None, None, bits=3, group_size=32)


@pytest.fixture
def pairs_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The outputs of the calls ``int_matmul`` makes into the pairs kernel's launcher."""
    from qpage.kernels import quant_pairs

    return spy(monkeypatch, quant_pairs, "pairs_matmul")


@pytest.mark.parametrize("layout", ["gptq", "gptq8", "awq"])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_pairs_kernel(layout: str, sym: bool, dtype: torch.dtype, pairs_calls: list[Any]) -> None:
    """The pairs kernels (4-bit, decode batches) at M = 2, 16 and 21; K unsplit, split serially
    in 2 and atomically in 3. GPTQ: K = 320 in 128-row tiles ends in a half-masked tile, N = 96
    in a partial column tile, and a per-channel weight (one group spanning K = 384); 8-bit
    GPTQ alike with 64- and 128-row tiles. AWQ:
    N = 136 ends in a partial word column of a 128- or 256-column tile, groups of 64 and 128."""
    if layout.startswith("gptq"):
        bits = 8 if layout == "gptq8" else 4
        weights = (make_weight(320, 96, bits, 128, sym=sym, seed=10),
                   make_weight(384, 64, bits, 384, sym=sym, seed=11))
        bk = 64 if bits == 8 else 128
        configs = (MatmulConfig(16, 64, bk, pairs=True), MatmulConfig(32, 32, 128, split_k=2, pairs=True),
                   MatmulConfig(16, 64, bk, split_k=3, serial=False, pairs=True))
    else:
        weights = (make_weight(320, 136, 4, 64, awq=True, sym=sym, seed=10),
                   make_weight(256, 128, 4, 128, awq=True, sym=sym, seed=11))
        configs = (MatmulConfig(16, 128, 64, pairs=True), MatmulConfig(32, 128, 32, split_k=2, pairs=True),
                   MatmulConfig(16, 256, 64, split_k=3, serial=False, pairs=True))
    for w in weights:
        for m in (2, 16, 21):
            x = torch.randn(m, w["q"].shape[0], generator=torch.Generator().manual_seed(m)).to(dtype)
            for cfg in configs:
                out, ref = run(x, w, cfg)
                assert out.shape == ref.shape and out.dtype == dtype
                assert rel_err(out, ref) < TOL[dtype], (m, cfg)
    assert len(pairs_calls) == 2 * 3 * len(configs)


@pytest.mark.parametrize(("awq", "bits", "act_order", "group", "block_k", "dtype"), [
    (True, 4, False, 128, 128, torch.float32), (False, 8, False, 128, 32, torch.float32),
    (False, 4, True, 128, 128, torch.float32), (False, 4, False, 64, 64, torch.float32),
    (False, 4, False, 64, 128, torch.float16)],
    ids=["awq-64-columns", "int8-bk32", "actorder", "bk64", "tile-across-groups"])
def test_pairs_falls_back_where_it_does_not_apply(awq: bool, bits: int, act_order: bool, group: int,
                                                  block_k: int, dtype: torch.dtype, pairs_calls: list[Any]) -> None:
    """A ``pairs`` config on a weight or tile the kernel does not take runs the general tl.dot
    kernel (same tiles) and still matches the reference."""
    w = make_weight(256, 64, bits, group, awq=awq, act_order=act_order, seed=12)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(13)).to(dtype)
    out, ref = run(x, w, MatmulConfig(16, 64, block_k, pairs=True))
    assert rel_err(out, ref) < TOL[dtype]
    assert pairs_calls == []


def test_cuda_defaults_route_decode_batches_to_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA heuristic (no GPU needed: the SM count and an empty tuned table are faked):
    M = 1 takes the GEMV, GPTQ weights (4 and 8 bits) with 2 <= M <= 32 the pairs kernel on
    128x128 tiles, AWQ with M <= 16 on 16x256 tiles, anything else (FP8, GPTQ groups too small
    for 16 words, M = 33) the tiles it had."""
    from types import SimpleNamespace

    from qpage.kernels import quant_matmul, tuned

    monkeypatch.setattr(quant_matmul, "INTERPRET", False)
    monkeypatch.setitem(tuned._INSTALLED, "cuda", {})  # an untuned GPU: the heuristic decides
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=128))
    quant_matmul.choose_config.cache_clear()
    try:
        cuda = torch.device("cuda")

        def pick(m: int, kind: str | None, group: int | None = 128) -> MatmulConfig:
            return quant_matmul.choose_config(cuda, kind, m, 14336, 4096, group)

        assert pick(1, "int4-g128").gemv and not pick(1, "int4-g128").pairs
        for m in (2, 16, 17, 32):
            cfg = pick(m, "int4-g128")
            assert cfg.pairs and (cfg.block_m, cfg.block_n, cfg.block_k) == (16 if m <= 16 else 32, 128, 128)
            assert cfg.split_k >= 1 and not cfg.gemv
        assert pick(8, "int4-chan", 4096).pairs and pick(8, "int8-chan", 4096).pairs
        assert pick(20, "int8-g128").pairs
        awq = pick(8, "awq-g128")
        assert awq.pairs and (awq.block_m, awq.block_n, awq.block_k) == (16, 256, 128)
        assert pick(8, "awq-g64", 64).pairs and not pick(20, "awq-g128").pairs
        for cfg in (pick(8, "fp8-chan", None), pick(8, "int4-g64", 64), pick(8, "int8-g32", 32),
                    pick(33, "int4-g128"), pick(8, None)):
            assert not cfg.pairs, cfg
    finally:
        quant_matmul.choose_config.cache_clear()
