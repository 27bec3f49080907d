"""Paged attention kernels (decode with/without split-KV, prefill over cached context) against
``*_ref`` on the same (dequantized) cache.

Tolerance: max |out - ref| <= 2e-3 for fp16 outputs (the acceptance bound; outputs are
O(1)), 1e-5 for fp32, 2e-2 for bf16 (its 8-bit mantissa).
"""

from __future__ import annotations

import math

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.attention.decode import paged_attention_decode
from qpage.kernels.attention.prefill import paged_attention_prefill
from qpage.kernels.attention.reference import paged_attention_decode_ref, paged_attention_prefill_ref
from qpage.kernels.attention.tiles import check_scale_offsets
from qpage.kernels.configs import DecodeConfig
from qpage.kernels.kv_quant import write_kv_cache_ref

TOL = {torch.float16: 2e-3, torch.float32: 1e-5, torch.bfloat16: 2e-2}
KVH, H, D = 2, 6, 64
MODES = [(None, False), ("e4m3", True), ("e4m3", False), ("e5m2", True)]
IDS = ["plain", "e4m3-token", "e4m3-tensor", "e5m2-token"]


def filled_cache(lens: list[int], dtype: torch.dtype, fmt: str | None, per_token: bool, seed: int = 0) -> dict:
    """A cache holding sequences of the given lengths in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(math.ceil(n / BLOCK_SIZE) for n in lens) + 4
    kc = torch.zeros(nb, BLOCK_SIZE, KVH, D, dtype=torch.uint8 if fmt else dtype)
    vc = torch.zeros_like(kc)
    if fmt and per_token:
        ks, vs = torch.zeros(nb, BLOCK_SIZE, KVH, dtype=torch.float16), torch.zeros(nb, BLOCK_SIZE, KVH,
                                                                                     dtype=torch.float16)
    elif fmt:
        ks, vs = torch.tensor([0.02]), torch.tensor([0.01])
    else:
        ks = vs = None
    perm = torch.randperm(nb, generator=g)
    width = max(math.ceil(n / BLOCK_SIZE) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nbk = math.ceil(n / BLOCK_SIZE)
        tables[i, :nbk] = perm[used : used + nbk]
        used += nbk
        pos = torch.arange(n)
        slots = tables[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, KVH, D, generator=g) * (1 + 3 * torch.rand(n, KVH, 1, generator=g))
        write_kv_cache_ref(k.to(dtype), torch.randn(n, KVH, D, generator=g).to(dtype), kc, vc, slots, ks, vs, fmt)
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, fp8_format=fmt), tables


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "per_token"), MODES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
def test_decode_matches_ref(fmt: str | None, per_token: bool, dtype: torch.dtype) -> None:
    lens = [37, 200, 1, 16, 129]
    cache, tables = filled_cache(lens, dtype, fmt, per_token)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = paged_attention_decode_ref(q, block_tables=tables, seq_lens=seq_lens, scale=D**-0.5, **cache)
    # The defaults (per-token scales loaded a tile ahead), split-KV, smaller tiles, the scales
    # loaded in their own tile, and FP8 V staged as fp16 (rows scaled).
    small = DecodeConfig(block_n=16, partition=64)
    for kw in ({}, {"partition": 64}, {"partition": 32, "config": small}, {"config": DecodeConfig(scales_ahead=False)},
               {"partition": 32, "config": DecodeConfig(block_n=16, partition=64, v_f16=True)},
               {"config": DecodeConfig(v_f16=True, scales_ahead=False, num_warps=8)}):
        out = paged_attention_decode(q, block_tables=tables, seq_lens=seq_lens, scale=D**-0.5, **cache, **kw)
        assert out.dtype == dtype
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype], (kw, err)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "per_token"), MODES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_prefill_matches_ref(fmt: str | None, per_token: bool, dtype: torch.dtype) -> None:
    """Chunks of 5, 40, 1 and 16 new tokens at the end of contexts of 37, 200, 1 and 16 (the
    last two have no earlier context; the first two attend to cached context)."""
    ctx = [37, 200, 1, 16]
    qlens = [5, 40, 1, 16]
    cache, tables = filled_cache(ctx, dtype, fmt, per_token, seed=2)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qlens), H, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    ref = paged_attention_prefill_ref(q, block_tables=tables, cu_seqlens_q=cu, context_lens=context_lens,
                                      scale=D**-0.5, **cache)
    for rows in (False, True):  # per-token scales on the scores and probabilities, or on the K/V rows
        out = paged_attention_prefill(q, block_tables=tables, cu_seqlens_q=cu, context_lens=context_lens,
                                      max_q_len=max(qlens), scale=D**-0.5, scale_rows=rows, **cache)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype], (rows, err)


def test_decode_ref_is_softmax_attention() -> None:
    """The reference itself, on a plain cache, equals a dense softmax over the sequence."""
    cache, tables = filled_cache([50], torch.float32, None, False)
    q = torch.randn(1, H, D)
    k = cache["k_cache"][tables[0].long()].reshape(-1, KVH, D)[:50].repeat_interleave(H // KVH, 1)
    v = cache["v_cache"][tables[0].long()].reshape(-1, KVH, D)[:50].repeat_interleave(H // KVH, 1)
    dense = torch.einsum("hl,lhd->hd", torch.einsum("hd,lhd->hl", q[0], k).mul(D**-0.5).softmax(-1), v)
    ref = paged_attention_decode_ref(q, block_tables=tables, seq_lens=torch.tensor([50]), scale=D**-0.5, **cache)
    assert torch.allclose(ref[0], dense, atol=1e-6)


def test_decode_compiles_once_as_the_context_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compile-time argument of the decode launch is the same for max_seq_len 1..300 (the
    partition length is a runtime argument): on a GPU a constexpr that followed the context
    length compiled a new kernel at every decode step."""
    import inspect

    from qpage.kernels.attention import decode

    kernel = decode._decode_kernel
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> object:
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(decode, "_decode_kernel", Recorder())
    cache, tables = filled_cache([300], torch.float16, "e4m3", True)
    q = torch.randn(1, H, D, dtype=torch.float16)
    for length in (1, 15, 16, 17, 64, 100, 255, 300):
        paged_attention_decode(q, cache["k_cache"], cache["v_cache"], tables, torch.tensor([length], dtype=torch.int32),
                               D**-0.5, cache["k_scale"], cache["v_scale"], "e4m3", max_seq_len=length)
    assert len(launches) == 8
    for name in launches[0]:
        if name not in ("num_warps", "num_stages"):
            assert "constexpr" in str(params[name].annotation), name
    assert all(kw == launches[0] for kw in launches), "a compile-time argument changed with the context length"


def test_dot_dtype_per_activation_and_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (the interpreter computes in fp32) the dots run in the activations' dtype,
    except FP8 codes under bf16 activations, which are exact in fp16 and multiplied there,
    unless per-token scales multiply the K/V rows (a bf16 model's values need not fit fp16)."""
    import triton.language as tl

    from qpage.kernels.attention import tiles

    monkeypatch.setattr(tiles, "INTERPRET", False)
    per_token = torch.ones(4, 16, 2, dtype=torch.float16)
    cases = [(torch.float16, None, None, False, tl.float16), (torch.bfloat16, None, None, False, tl.bfloat16),
             (torch.bfloat16, "e4m3", per_token, False, tl.float16),
             (torch.bfloat16, "e5m2", None, True, tl.float16),  # per-tensor: nothing multiplies the rows
             (torch.bfloat16, "e4m3", per_token, True, tl.bfloat16),
             (torch.float16, "e4m3", per_token, True, tl.float16)]
    for dtype, fmt, k_scale, rows, want in cases:
        _, flags = tiles.launch_args(torch.zeros(1, 4, 8, dtype=dtype), k_scale, fmt, 1.0, scaled_rows=rows)
        assert flags["DOT_DTYPE"] == want, (dtype, fmt, rows)


def test_per_token_scales_past_32_bit_offsets_are_refused() -> None:
    """The kernels index per-token scales with 32-bit offsets; a scale tensor of 2**31 elements
    (an expanded view: no memory) is refused by name before any launch, decode and prefill alike."""
    cache, tables = filled_cache([20], torch.float16, "e4m3", True)
    huge = torch.ones(1, 1, 1, dtype=torch.float16).expand(2**27, BLOCK_SIZE, 1)
    assert huge.numel() == 2**31
    q = torch.randn(1, H, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="32-bit offsets"):
        paged_attention_decode(q, cache["k_cache"], cache["v_cache"], tables, torch.tensor([20], dtype=torch.int32),
                               0.125, k_scale=huge, v_scale=huge, fp8_format="e4m3")
    with pytest.raises(ValueError, match="32-bit offsets"):
        paged_attention_prefill(q, cache["k_cache"], cache["v_cache"], tables, torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([20], dtype=torch.int32), 1, 0.125, k_scale=huge, v_scale=huge,
                                fp8_format="e4m3")
    check_scale_offsets(huge[: 2**27 - 1])  # one block fewer fits
