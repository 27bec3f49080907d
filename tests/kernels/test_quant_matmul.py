"""INT4/INT8 matmuls (GPTQ and AWQ layouts; GEMV, tiled and dequant kernels) against the torch
reference, and the kernel selection.

Tolerances, ||out - ref|| / ||ref|| against ``int_matmul_ref`` on the same packed weights
(fp32 math, output cast to the activation dtype): fp32 1e-5, fp16 2e-3, bf16 1e-2 (the
output dtype's rounding; accumulation is fp32 in both).
"""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.configs import MatmulConfig
from qpage.kernels.int_matmul import int_matmul
from qpage.kernels.packing import dequantize_ref, int_matmul_ref, pack_cols, pack_rows, unpack_cols, unpack_rows
from tests.kernels.conftest import rel_err

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


@pytest.mark.slow
@pytest.mark.parametrize(("awq", "bits"), [(False, 4), (True, 4), (False, 8)], ids=["gptq4", "awq4", "gptq8"])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gemv_and_split_k(awq: bool, sym: bool, bits: int, dtype: torch.dtype) -> None:
    """M=1 through the GEMV kernel (split K in 2 and 3) and the tiled kernel with split K in 4.
    K = 324 ends in a half-filled word and a short last tile; N = 96 a partial column tile."""
    w = make_weight(324, 96, bits, 64, awq=awq, sym=sym, seed=3)
    x = torch.randn(1, 324, generator=torch.Generator().manual_seed(4)).to(dtype)
    for cfg in (MatmulConfig(16, 32, 64, split_k=2, kind="gemv"), MatmulConfig(16, 64, 64, split_k=3, kind="gemv"),
                MatmulConfig(16, 32, 32, split_k=4)):
        out, ref = run(x, w, cfg)
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype], cfg


@pytest.mark.parametrize("kernel", ["gemv", "tiled", "fp8"])
def test_split_k_is_deterministic_and_resets_its_counters(kernel: str) -> None:
    """The split-K reduction sums the partials in a fixed order (two calls give the same bits,
    equal to the unsplit kernel's within fp32 rounding) and leaves every counter at zero, so
    the next launch (another shape, another grid) starts clean."""
    from qpage.kernels.fp8.matmul import fp8_matmul
    from qpage.kernels.split_k import tile_locks

    w = make_weight(512, 192, 4, 64, seed=5)
    x = torch.randn(3 if kernel != "gemv" else 1, 512, generator=torch.Generator().manual_seed(6))
    f8 = (torch.randn(192, 512, generator=torch.Generator().manual_seed(7)) * 50).to(torch.float8_e4m3fn)
    s8 = torch.rand(192) * 0.01

    def call(split: int) -> torch.Tensor:
        cfg = MatmulConfig(16, 64, 64, split_k=split, kind="gemv" if kernel == "gemv" else "tiled")
        return fp8_matmul(x, f8, s8, cfg) if kernel == "fp8" else run(x, w, cfg)[0]

    a, b, whole = call(4), call(4), call(1)
    assert torch.equal(a, b)
    assert rel_err(a, whole) < 1e-6
    assert int(tile_locks(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize(("awq", "act_order", "bits", "sym"),
                         [(False, False, 4, False), (False, True, 4, False), (True, False, 4, False),
                          (True, False, 4, True), (False, False, 8, True)],
                         ids=["gptq", "gptq-actorder", "awq", "awq-sym", "int8"])
def test_dequant_path(awq: bool, act_order: bool, bits: int, sym: bool) -> None:
    """The dequantize-then-matmul path (prefill-sized M), whose dense weight equals
    ``dequantize_ref`` bit for bit in fp32, built in column chunks."""
    from qpage.kernels.int_matmul.dequant import dequant_matmul, dequantize_int

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
    assert rel_err(run(x, w, MatmulConfig(128, 128, 64, kind="dequant"))[0], ref) < TOL[torch.float32]
    chunked = dequant_matmul(x, *args, bits=bits, group_size=64, awq=awq, max_chunk_bytes=k * 4 * 128)
    assert rel_err(chunked, ref) < TOL[torch.float32]


def test_rejects_unsupported_bits() -> None:
    w = make_weight(64, 32, 4, 32)
    with pytest.raises(ValueError, match="bits=3"):
        int_matmul(torch.randn(1, 64), w["qweight"], w["scales"], None, None, bits=3, group_size=32)


def test_a_config_its_kernel_cannot_run_is_refused() -> None:
    """An explicit config is run as asked or refused with the kernel's reason: the GEMV serves
    one row of a weight without act-order whose groups hold whole K tiles."""
    w = make_weight(256, 64, 4, 64, act_order=True, seed=12)
    cases = ((2, w, "gemv", "one activation row"), (1, w, "gemv", "act-order"),
             (1, make_weight(256, 64, 4, 32, seed=12), "gemv", "does not divide the group size"))
    for m, weight, kind, why in cases:
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(13))
        with pytest.raises(ValueError, match=why):
            run(x, weight, MatmulConfig(16, 64, 64, kind=kind))
    awq = make_weight(256, 64, 4, 64, awq=True, seed=12)
    with pytest.raises(ValueError, match="multiples of 8"):
        run(torch.randn(3, 256), awq, MatmulConfig(16, 4, 64))


def test_cuda_defaults_by_regime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA selection (no GPU needed: the SM count and the interpreter flag are faked, the
    tuned table emptied): one row takes the GEMV, up to 255 rows the tiled kernel, from 256 the
    dequantize-then-cuBLAS path; the GEMV passes to the tiled kernel where it cannot run
    (act-order, or a group smaller than its K tile), and a tuned config the kernel cannot run
    gives way to the default."""
    from types import SimpleNamespace

    from qpage.kernels import configs, tuned
    from qpage.kernels.int_matmul import select

    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setitem(tuned._INSTALLED, "cuda", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=128))
    caches = (select.choose_config, configs.default_matmul_config, configs._sm_count, tuned.tuned_matmul_config)
    for c in caches:
        c.cache_clear()
    try:
        cuda = torch.device("cuda")

        def pick(m: int, group: int = 128, act_order: bool = False) -> MatmulConfig:
            return select.choose_config(cuda, m, 14336, 4096, 4, group, False, act_order)

        assert pick(1).kind == "gemv" and pick(1).split_k > 1
        assert {pick(m).kind for m in (2, 16, 17, 255)} == {"tiled"}
        assert pick(256).kind == "dequant"
        assert pick(1, act_order=True).kind == "tiled"
        assert pick(1, group=8).kind == "tiled"  # block_k 128 spans several groups of 8
        bad = {"matmul": {"int4-g128": {"4096x14336": {"1": {"block_m": 16, "block_n": 64, "block_k": 256,
                                                             "kind": "gemv"}}}}}
        tuned.install(cuda, bad)
        select.choose_config.cache_clear()
        assert pick(1) == configs.default_matmul_config(1, 14336, 4096, cuda, 128)
    finally:
        for c in caches:
            c.cache_clear()
