"""The block-format matmuls (``kernels.cpu.matmul.native_gguf``) against the ``gguf`` package.

Weights are quantized by ``gguf.quants.quantize`` (llama.cpp's reference quantizers; the
K-quants and IQ4, which it cannot write, as random blocks with d in [0.001, 0.011): any other
byte pattern is a valid block; Q2_K, which the kernels hold as Q8_0, is compared as that) and the
reference is ``gguf.quants.dequantize`` (for bitsandbytes' NF4 and FP4 blocks, written by
``formats.bnb`` from random codes, d times the codebook as ``formats.bnb`` defines its int8
form) times the activations as the kernel quantized them
(codes x block scale, plus the residual level's for the 8-bit formats), in fp64: the kernel's
only differences are fp32 rounding and the order of additions, held to 1e-5 relative to the
output's norm. Against the unquantized fp32 activations one int8 level costs more (amax/254 per
element at most): held to 1e-2; two levels (amax/254^2): held to 1e-4.
Every format runs on every instruction path this CPU has (others are skipped, by name).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from qpage.kernels.cpu import native as cpu_native  # noqa: E402
from qpage.kernels.cpu.matmul import block_rewrite  # noqa: E402
from qpage.kernels.cpu.matmul import native_gguf as ng  # noqa: E402
from qpage.kernels.cpu.matmul.dense import DensePanels  # noqa: E402
from tests.kernels.conftest import rel_err  # noqa: E402
from tests.kernels.gguf_weights import RANDOM, TYPES, quantized_weight  # noqa: E402

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

K_QUANTS = {name for name, (size, _, _) in RANDOM.items() if size == 256}
ISAS = ("scalar", "avx2", "vnni")
# (m, n, k): decode rows, a 4- or 8-row call plus a remainder, rows not a multiple of 16 (a
# last group of 6, 1, 8 and 12 rows: both AVX2 halves and the VNNI store mask), an odd number
# of blocks, a row of one block, and activation rows over several 32-row tiles.
SHAPES = [(1, 70, 576), (3, 33, 96), (5, 64, 1536), (17, 40, 64), (2, 16, 32), (2, 44, 96), (75, 20, 64)]
BNB_SHAPES = [(1, 70, 576), (3, 33, 128), (5, 64, 1536), (17, 40, 64), (2, 44, 192), (75, 20, 64)]
"""The same in whole 64-weight bitsandbytes blocks."""
K_SHAPES = [(1, 70, 512), (3, 33, 256), (5, 64, 1536), (17, 40, 768), (2, 16, 256), (75, 20, 256)]
"""The same for the 256-weight K-quant blocks."""
TOL, TOL_FP32, TOL_FP32_RESIDUAL = 1e-5, 1e-2, 1e-4


def isa_or_skip(isa: str) -> None:
    if not ng.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa} path")


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32) * 3)


def act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and per-block scales: amax / 127, codes rounded half to even."""
    m, k = x.shape
    blocks = x.double().view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.view(m, k).to(torch.int8), d


@pytest.mark.parametrize(("m", "k"), [(6, 128), (80, 1024)])  # the second splits rows across threads
def test_activation_quantization_matches_reference(m: int, k: int) -> None:
    x = activations(m, k, 0)
    x[2, :32] = 0  # an all-zero block: scale 0, codes 0
    act = ng.quantize_activations(x, residual=True)
    q, d = act_ref(x)
    assert torch.equal(act.q, q)
    assert torch.allclose(act.d.double(), d, rtol=1e-7, atol=0)
    sums = act.q.view(m, k // 32, 32).sum(-1).double()
    assert torch.allclose(act.s.double(), act.d.double() * sums, rtol=1e-6, atol=1e-6)
    # The residual level: what the first leaves, quantized the same way. The kernel computes x - d q in
    # fp32 and may fuse the multiply-add: the residual (~ amax / 254) then differs from torch's by an
    # ulp of x, up to 254 * 2^-23 = 3e-5 of its own size.
    assert act.r is not None and act.rd is not None and act.rs is not None
    left = x - (act.q.float().view(m, k // 32, 32) * act.d[..., None]).view(m, k)
    _, dr = act_ref(left)
    assert torch.allclose(act.rd.double(), dr, rtol=5e-5, atol=0)
    r_seen = act.r.double().view(m, k // 32, 32) * act.rd.double()[..., None]
    ulp_x = x.double().abs().view(m, k // 32, 32) * 2.0**-23
    miss = (left.double().view(m, k // 32, 32) - r_seen).abs() - act.rd.double()[..., None] / 2
    assert bool((miss <= 2 * ulp_x + 1e-12).all())
    assert torch.allclose(act.rs.double(), act.rd.double() * act.r.view(m, k // 32, 32).sum(-1).double(),
                          rtol=1e-6, atol=1e-9)
    one = ng.quantize_activations(x)
    assert one.r is None and torch.equal(one.q, act.q) and torch.equal(one.s, act.s)
    assert float((act.seen() - x.double()).abs().max()) <= float(x.abs().max()) / 254**2 * 1.01


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("name", "shape"), [
    (name, shape) for name in TYPES
    for shape in (K_SHAPES if name in K_QUANTS else BNB_SHAPES if name in ("NF4", "FP4") else SHAPES)])
def test_matmul_matches_gguf_dequantize(name: str, isa: str, shape: tuple[int, int, int]) -> None:
    isa_or_skip(isa)
    m, n, k = shape
    rows, w = quantized_weight(name, n, k, seed=m + n + k)
    x = activations(m, k, seed=n)
    residual = ng.needs_residual(TYPES[name])
    act = ng.quantize_activations(x, residual=residual)
    ref = act.seen() @ w.double().t()
    out = torch.full((m, n), float("nan"))
    ng.matmul_into(out, act, ng.repack(rows, TYPES[name], k), isa=isa)
    assert rel_err(out, ref) < TOL
    assert rel_err(out, x.double() @ w.double().t()) < (TOL_FP32_RESIDUAL if residual else TOL_FP32)


@pytest.mark.parametrize("name", TYPES)
def test_threads_and_paths_agree(name: str) -> None:
    """Splitting rows across threads changes no row's arithmetic: equal bit for bit."""
    rows, _ = quantized_weight(name, 200, 256, seed=3)  # k = 256 fits every format
    w = ng.repack(rows, TYPES[name], 256)
    act = ng.quantize_activations(activations(7, 256, 3), residual=ng.needs_residual(TYPES[name]))
    one, two = torch.empty(7, 200), torch.empty(7, 200)
    ng.matmul_into(one, act, w, threads=1)
    ng.matmul_into(two, act, w, threads=2)
    assert torch.equal(one, two)


@pytest.mark.parametrize("name", TYPES)
def test_paths_agree(name: str) -> None:
    """Every path this CPU has computes the same sums, in its own order of float additions."""
    k = 512 if name in K_QUANTS else 320 if name not in ("NF4", "FP4") else 384
    rows, _ = quantized_weight(name, 60, k, seed=4)
    w = ng.repack(rows, TYPES[name], k)
    act = ng.quantize_activations(activations(5, k, 4), residual=ng.needs_residual(TYPES[name]))
    outs = {}
    for isa in ISAS:
        if ng.isa_supported(isa):
            outs[isa] = torch.empty(5, 60)
            ng.matmul_into(outs[isa], act, w, isa=isa)
    for isa, out in outs.items():
        assert rel_err(out, outs["scalar"]) < TOL, isa


def test_non_finite_activations_give_nan_rows() -> None:
    rows, _ = quantized_weight("Q4_1", 16, 64, seed=2)
    x = activations(3, 64, 2)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    out = torch.empty(3, 16)
    ng.matmul_into(out, ng.quantize_activations(x), ng.repack(rows, TYPES["Q4_1"], 64))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()


@pytest.mark.parametrize("name", TYPES)
def test_rows_dequantize_exactly(name: str) -> None:
    """Embedding rows read from the kernels' layout equal llama.cpp's dequantization exactly."""
    k = 256 if name in K_QUANTS else 96 if name not in ("NF4", "FP4") else 128
    rows, w = quantized_weight(name, 37, k, seed=5)
    packed = ng.repack(rows, TYPES[name], k)
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(ng.dequantize_rows(packed, ids), w[ids])
    with pytest.raises(ValueError, match=r"outside \[0, 37\)"):
        ng.dequantize_rows(packed, torch.tensor([37]))


def test_pieces_of_mixed_formats_fill_their_columns() -> None:
    """A fused projection whose parts are Q4_1, Q8_0, Q8_M and fp32 (dense panels): one output,
    each part in its columns, activations quantized once (with the residual level, which only
    the Q8_M part reads)."""
    k = 128
    parts = [("Q4_1", 48), ("Q8_0", 16), ("Q8_M", 32), ("F32", 20)]  # k = 128: no K-quant part
    x = activations(3, k, 9)
    act = ng.quantize_activations(x, residual=True)
    one_level = ng.QuantizedActivations(act.q, act.d, act.s).seen()
    pieces, refs, c0 = [], [], 0
    for i, (name, n) in enumerate(parts):
        if name == "F32":
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(i))
            pieces.append((c0, c0 + n, DensePanels(w)))
            refs.append(x.double() @ w.double().t())
        else:
            rows, w = quantized_weight(name, n, k, seed=i)
            pieces.append((c0, c0 + n, ng.repack(rows, TYPES[name], k)))
            refs.append((act.seen() if ng.needs_residual(TYPES[name]) else one_level) @ w.double().t())
        c0 += n
    mm = ng.PiecewiseMatmul(pieces, k, c0)
    assert mm.residual
    assert rel_err(mm(x), torch.cat(refs, 1)) < TOL
    with pytest.raises(ValueError, match="do not tile"):
        ng.PiecewiseMatmul(pieces[:1] + pieces[2:], k, c0)


def test_rewritten_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q3_K runs as Q6_K with the same weights bit for bit; Q2_K as Q8_0, each weight within
    1/254 of its 32-block's largest magnitude plus the fp16 rounding of the block's scale.
    Rewrites go a few rows at a time: the same bytes as all at once."""
    rows, _ = quantized_weight("Q3_K", 24, 512, seed=6)
    exact = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q3_K)
    whole = block_rewrite.q3k_as_q6k(rows)
    assert np.array_equal(gguf.quants.dequantize(whole, gguf.GGMLQuantizationType.Q6_K), exact)
    q2_rows, _ = quantized_weight("Q2_K", 24, 512, seed=7)
    q2_whole = block_rewrite.q2k_as_q8_0(q2_rows)
    monkeypatch.setattr(block_rewrite, "REWRITE_CHUNK", 5 * 512)  # 5 rows a chunk
    assert np.array_equal(block_rewrite.q3k_as_q6k(rows), whole)
    assert np.array_equal(block_rewrite.q2k_as_q8_0(q2_rows), q2_whole)
    rows, held = quantized_weight("Q2_K", 24, 512, seed=7)
    exact = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q2_K).reshape(24, 16, 32)
    amax = np.abs(exact).max(-1, keepdims=True)
    assert (np.abs(held.numpy().reshape(24, 16, 32) - exact) <= amax * (1 / 254 + 2**-10)).all()


def test_mxfp4_rewrite_is_exact_and_refuses_scales_beyond_fp16() -> None:
    """MXFP4 on IQ4_NL's block with its codebook: the same weights bit for bit (held to the
    ``gguf`` package's MXFP4 dequantization), scales 2^-23..2^16 and all-zero blocks (written
    with e = 0) included; exponents that fp16 cannot hold are refused by name."""
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((8, 128)) * np.exp2(rng.integers(-22, 14, (8, 1)))).astype(np.float32)
    w[3, 32:64] = 0.0
    rows = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    assert rows[3, 17] == 0  # the zero block's exponent
    want = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
    held = ng.dequantize_rows(ng.repack(rows, ng.MXFP4, 128), torch.arange(8)).numpy()
    assert np.array_equal(held, want)
    bad = rows.copy()
    bad[0, 0] = 150  # a block scale of 2^23
    with pytest.raises(ValueError, match="MXFP4 block scale"):
        ng.repack(bad, ng.MXFP4, 128)


def test_unsupported_inputs_are_named() -> None:
    assert "no native kernel" in (ng.unsupported_reason(16, 256) or "")  # IQ2_XXS
    assert "32-weight blocks" in (ng.unsupported_reason(2, 48) or "")
    assert "256-weight blocks" in (ng.unsupported_reason(14, 576) or "")
    rows, _ = quantized_weight("Q8_0", 16, 64, seed=1)
    with pytest.raises(ValueError, match=r"uint8 \[n, 68\]"):
        ng.repack(rows[:, :60], TYPES["Q8_0"], 64)
    w = ng.repack(rows, TYPES["Q8_0"], 64)
    with pytest.raises(ValueError, match="need fp32 out"):
        ng.matmul_into(torch.empty(1, 15), ng.quantize_activations(activations(1, 64, 0)), w)
    assert ng.best_isa() in ISAS and ng.isa_supported(ng.best_isa())


def test_block_table_read_from_c_states_the_file_formats() -> None:
    """The kernels' own table (C, read through ``block_types``) gives each ggml format's block
    as gguf's table does; NF4 and FP4 sit on IQ4_NL's block, Q8_M is Q8_0's plus an fp16 m; a
    packed block is never smaller."""
    types = ng.block_types()
    assert set(types) == set(TYPES.values()), types  # every format the tests run
    q8 = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]
    for t, bt in types.items():
        if t == ng.Q8_M:
            assert (bt.weights, bt.file_bytes) == (q8[0], q8[1] + 2)
            continue
        file_type = gguf.GGMLQuantizationType(ng.IQ4_NL if t in ng.NAMES else t)
        assert (bt.weights, bt.file_bytes) == gguf.GGML_QUANT_SIZES[file_type], t
        assert bt.packed_bytes >= bt.file_bytes, t
