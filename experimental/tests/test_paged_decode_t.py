"""The tokens-as-rows FP8 decode kernel (``paged_decode_t``) against the reference, under the
interpreter (fp32; its inline PTX by the PTX model), its query arithmetic, and when it runs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from qpage.kernels.fp8_codec import decode_fp8_ref
from qpage.kernels.paged_attention import LOG2E, paged_attention_decode, paged_attention_decode_ref
from qpage.kernels.paged_decode_t import decode_t_unfit, quantize_queries_ref
from tests.kernels.ptx_model import run_ptx

from qpage.kernels import paged_attention as pa
from qpage.kernels import paged_decode_t as pdt
from tests.kernels.conftest import rel_err, spy
from tests.kernels.test_paged_attention import D, H, filled_cache

SCALE = 0.125


def _decode(cache: dict, tables: torch.Tensor, q: torch.Tensor, lens: list[int], **kw: object) -> torch.Tensor:
    return paged_attention_decode(q, cache["k_cache"], cache["v_cache"], tables, torch.tensor(lens, dtype=torch.int32),
                                  SCALE, k_scale=cache["k_scale"], v_scale=cache["v_scale"], fp8_format="e4m3", **kw)


def _ref(cache: dict, tables: torch.Tensor, q: torch.Tensor, lens: list[int]) -> torch.Tensor:
    return paged_attention_decode_ref(q, **cache, block_tables=tables, seq_lens=torch.tensor(lens), scale=SCALE)


@pytest.mark.parametrize(("fmt", "per_token", "qk_fp8"),
                         [("e4m3", True, True), ("e4m3", True, False), ("e4m3", False, True), ("e4m3", False, False),
                          ("e5m2", True, False)], ids=["e4m3-token-qk8", "e4m3-token", "e4m3-tensor-qk8",
                                                       "e4m3-tensor", "e5m2-token"])
@pytest.mark.parametrize("partition", [None, 32], ids=["one-partition", "split"])
def test_decode_t_matches_ref(fmt: str, per_token: bool, qk_fp8: bool, partition: int | None) -> None:
    """fp32 under the interpreter (tolerance 1e-5, as the other kernel's fp32 case); with
    ``qk_fp8`` the reference takes q as the kernel multiplies it (``quantize_queries_ref``)."""
    lens = [37, 70, 5]
    cache, tables = filled_cache(lens, torch.float32, fmt, per_token, seed=3)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1))
    got = paged_attention_decode(q, cache["k_cache"], cache["v_cache"], tables, torch.tensor(lens, dtype=torch.int32),
                                 SCALE, k_scale=cache["k_scale"], v_scale=cache["v_scale"], fp8_format=fmt,
                                 decode_t=True, qk_fp8=qk_fp8, partition=partition)
    want = _ref(cache, tables, quantize_queries_ref(q, SCALE * LOG2E) if qk_fp8 else q, lens)
    assert rel_err(got, want) < 1e-5
    if qk_fp8:  # the split query moves the output by about 1e-3 of its norm, no more
        assert 1e-5 < rel_err(want, _ref(cache, tables, q, lens)) < 3e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_t_half_queries(dtype: torch.dtype) -> None:
    """fp16 and bf16 models (on a GPU: fp16 MMAs, P times V's scale shifted by 2**8 for fp16
    only, ``p_shift``); the output in the model's dtype, within its rounding (TOL of the other
    kernel's tests)."""
    lens = [33, 18]
    cache, tables = filled_cache(lens, dtype, "e4m3", True, seed=7)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = _decode(cache, tables, q, lens, decode_t=True, qk_fp8=True)
    assert got.dtype == dtype
    want = _ref(cache, tables, quantize_queries_ref(q, SCALE * LOG2E), lens)
    assert rel_err(got, want) < (2e-3 if dtype == torch.float16 else 2e-2)
    assert pdt.p_shift(torch.bfloat16) == 1.0


def test_decode_t_sixteen_query_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``q_pad=16`` (FP8 wgmma with Triton < 3.8) computes the same; q K^T in FP8 is the default
    from Triton 3.8 only (``default_qk_fp8``), and the tuned table's ``qk_fp8`` wins over it."""
    lens = [21, 50]
    cache, tables = filled_cache(lens, torch.float32, "e4m3", True, seed=5)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(2))
    got = _decode(cache, tables, q, lens, decode_t=True, qk_fp8=True, q_pad=16)
    assert rel_err(got, _ref(cache, tables, quantize_queries_ref(q, SCALE * LOG2E), lens)) < 1e-5
    for version, want in (("3.6.0", False), ("3.7.1", False), ("3.8.0", True), ("3.9.0", True)):
        monkeypatch.setattr(pdt.triton, "__version__", version)
        pdt._triton_version.cache_clear()
        assert pdt.default_qk_fp8() is want
        assert pa.decode_kernel_choice(q, cache["k_cache"], "e4m3", {}, True) == (True, want)
        assert pa.decode_kernel_choice(q, cache["k_cache"], "e4m3", {"qk_fp8": not want}, True) == (True, not want)
    pdt._triton_version.cache_clear()


def test_decode_t_all_loads_pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    """``loop_stages`` (every load of the loop pipelined by ``tl.range``) and the register cap
    reach the launch from the arguments and from a tuned table, and change nothing computed;
    the cap applies where the static counts chose it (sm_90, 4 warps, 64-token tiles)."""
    lens = [45, 9]
    cache, tables = filled_cache(lens, torch.float32, "e4m3", True, seed=6)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(8))
    want = _ref(cache, tables, quantize_queries_ref(q, SCALE * LOG2E), lens)
    seen: list[dict] = []
    real = pdt._decode_t_kernel

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kw: object) -> object:
                seen.append(kw)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(pdt, "_decode_t_kernel", Recorder())
    got = _decode(cache, tables, q, lens, decode_t=True, qk_fp8=True, loop_stages=3, partition=32, maxnreg=72)
    assert rel_err(got, want) < 1e-5
    assert seen[-1]["LOOP_STAGES"] == 3 and seen[-1]["maxnreg"] == 72
    tuned = {"decode_t": True, "qk_fp8": True, "loop_stages": 2}
    monkeypatch.setattr(pa, "decode_settings", lambda *a: tuned)
    assert rel_err(_decode(cache, tables, q, lens), want) < 1e-5
    assert seen[-1]["LOOP_STAGES"] == 2 and "maxnreg" not in seen[-1]  # the interpreter: no default cap
    assert pdt.default_maxnreg((9, 0), 4, 64, 8) == 80 and pdt.default_maxnreg((9, 0), 4, 64, 16) == 96
    for args in (((9, 0), 8, 64, 8), ((9, 0), 4, 128, 8), ((8, 9), 4, 64, 8), ((8, 0), 4, 64, 8), (None, 4, 64, 8)):
        assert pdt.default_maxnreg(*args) is None, args


def test_quantize_queries_split_error() -> None:
    """e4m3 alone leaves up to 2**-4 relative per element (of the larger ones); hi + lo (the
    kernel's split) cuts the error more than 8-fold, to below 2**-8 of each head's largest |q|."""
    q = torch.randn(64, 8, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 8)[None, :, None]
    one = quantize_queries_ref(q, split=False)
    two = quantize_queries_ref(q)
    amax = q.abs().amax(-1, keepdim=True)
    big = q.abs() > amax * 2**-6  # e4m3 normals under the per-head scale
    assert ((one - q).abs()[big] <= q.abs()[big] * 2**-4 * (1 + 1e-6)).all()
    assert ((two - q).abs() <= amax * 2**-8).all()
    assert (two - q).norm() * 8 < (one - q).norm()
    assert quantize_queries_ref(torch.zeros(2, 3, 8)).abs().max() == 0


WORD_DECODERS = [("E4M3_WORD_PTX", "e4m3", 1.0), ("E4M3_BITS_WORD_PTX", "e4m3", 256.0), ("E5M2_WORD_PTX", "e5m2", 1.0)]


@pytest.mark.parametrize(("name", "fmt", "unit"), WORD_DECODERS)
def test_word_ptx_bit_for_bit(name: str, fmt: str, unit: float) -> None:
    """The word decoders in the PTX model: every code in every byte of a word, and random words,
    decode to torch's float8 value (over the decoder's unit) in output ``$i`` for byte i. The
    hardware conversion and e5m2 keep NaN and infinity; the e4m3 bit trick gives the NaN code a
    finite value (the cache write never stores it: it saturates)."""
    codes = np.arange(256, dtype=np.uint32)
    words = [codes << (8 * i) | ((255 - codes) << (8 * ((i + 1) % 4))) for i in range(4)]
    words.append(np.random.default_rng(0).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32))
    word = np.concatenate(words)
    out = run_ptx(getattr(pdt, name).value, {4: word})
    for i in range(4):
        byte = torch.from_numpy(((word >> (8 * i)) & 0xFF).astype(np.uint8))
        want = (decode_fp8_ref(byte, fmt) / unit).half().numpy()
        got = out[i].astype(np.uint16).view(np.float16)
        finite = np.isfinite(want)
        assert (got[finite].view(np.uint16) == want[finite].view(np.uint16)).all(), f"byte {i}"
        if name != "E4M3_BITS_WORD_PTX":
            assert (np.isnan(got) == np.isnan(want)).all() and (np.isinf(got) == np.isinf(want)).all()


def test_when_it_runs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Opt-in (argument, tuned table or QPAGE_DECODE_T=1); asked for explicitly where it cannot
    run it raises naming why; asked for by the environment it logs the reason and the other
    kernel serves the call."""
    lens = [20, 9]
    cache, tables = filled_cache(lens, torch.float32, "e4m3", True)
    q = torch.randn(len(lens), H, D)
    launches = spy(monkeypatch, pa, "launch_decode_t")
    _decode(cache, tables, q, lens)
    assert not launches
    monkeypatch.setenv("QPAGE_DECODE_T", "1")
    _decode(cache, tables, q, lens)
    assert len(launches) == 1
    assert decode_t_unfit(q.half(), cache["k_cache"], "e4m3") is None  # any float dtype under the interpreter
    assert decode_t_unfit(q.double(), cache["k_cache"], "e4m3") == "torch.float64 queries"
    assert decode_t_unfit(q, cache["k_cache"], "e5m2") is None
    assert "not FP8" in decode_t_unfit(q, cache["k_cache"], None)
    assert "takes e4m3 codes" in pdt.qk_fp8_unfit(q, "e5m2")
    assert "multiples of 4" in decode_t_unfit(q[..., :62], cache["k_cache"][..., :62].contiguous(), "e4m3")
    assert "at least 32" in decode_t_unfit(q[..., :16], cache["k_cache"][..., :16].contiguous(), "e4m3")
    e5, tables5 = filled_cache(lens, torch.float32, "e5m2", True)
    seq = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qk_fp8=True: q K\^T in FP8 takes e4m3 codes"):
        paged_attention_decode(q, e5["k_cache"], e5["v_cache"], tables5, seq, SCALE, k_scale=e5["k_scale"],
                               v_scale=e5["v_scale"], fp8_format="e5m2", decode_t=True, qk_fp8=True)
    plain, tables16 = filled_cache(lens, torch.float32, None, False)
    with pytest.raises(ValueError, match=r"decode_t=True: the cache is not FP8"):
        paged_attention_decode(q, plain["k_cache"], plain["v_cache"], tables16, seq, SCALE, decode_t=True)
    with caplog.at_level(logging.INFO, logger="qpage"):  # the environment asks; the default kernel serves
        got = paged_attention_decode(q, plain["k_cache"], plain["v_cache"], tables16, seq, SCALE)
    assert len(launches) == 1 and "not FP8" in caplog.text
    assert rel_err(got, paged_attention_decode_ref(q, **plain, block_tables=tables16, seq_lens=seq, scale=SCALE)) < 1e-5


def test_first_use_check(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``decode_t_ok`` runs the kernel against the reference once per device: it passes here, and
    a reference that disagrees (a stand-in for a GPU whose PTX or FP8 MMA misbehaves) makes it
    fail with a warning, after which the environment's request falls back to the default kernel."""
    monkeypatch.setattr(pdt, "_CHECKED", {})
    assert pdt.decode_t_ok(torch.device("cpu"))
    monkeypatch.setattr(pdt, "_CHECKED", {})
    real = pdt.quantize_queries_ref
    monkeypatch.setattr(pdt, "quantize_queries_ref", lambda q, s=1.0, split=True: real(q, s, split) * 1.05)
    with caplog.at_level(logging.WARNING, logger="qpage"):
        assert not pdt.decode_t_ok(torch.device("cpu"))
    assert "using the default decode kernel" in caplog.text
    # A kernel this Triton cannot compile fails the check the same way, naming the error.
    monkeypatch.setattr(pdt, "_CHECKED", {})

    def cannot_compile(*args: object) -> float:
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(pdt, "_check_error", cannot_compile)
    with caplog.at_level(logging.WARNING, logger="qpage"):
        assert not pdt.decode_t_ok(torch.device("cpu"))
    assert "RuntimeError: PassManager::run failed" in caplog.text
