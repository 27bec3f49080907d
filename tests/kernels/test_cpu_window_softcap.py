"""Sliding-window and soft-capped attention in the C backend (``cpu-native``) against the torch
reference (``backends.masked_attention``), for every cache kind it reads: fp32, FP8 (per token
and per tensor), int8 and int4.

Each case mixes decode rows and a prompt chunk whose rows span the window's edge. The blocks
before every row's window are given back (block 0 in the tables, as the KV manager leaves
them), and block 0 holds NaN in the fp32 case: the C kernels must not read it. Tolerance: 2e-6
relative to the reference's norm (fp32 summation order and the C exp and tanh).
"""

from __future__ import annotations

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu import native as cpu_native
from qpage.layers.attention.backends import CpuNativePagedAttention, masked_attention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan, build_torch_metadata
from tests.kernels.conftest import rel_err

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

SPECS = {"fp32": KVCacheSpec(torch.float32), "e4m3": KVCacheSpec(torch.float32, "e4m3", True),
         "e5m2-per-tensor": KVCacheSpec(torch.float32, "e5m2", False), "int8": KVCacheSpec.from_config(
             "int8", "per_token", torch.float32), "int4": KVCacheSpec.from_config("int4", "per_token", torch.float32)}


def _case(spec: KVCacheSpec, window: int, kvh: int, hd: int) -> tuple:
    """A cache of 4 sequences' blocks (block 0 kept aside), their K/V written through the
    reference writer; decode rows at 3 lengths and a 24-row prompt chunk ending at 70."""
    g = torch.Generator().manual_seed(5)
    lens = [150, 40, window + 1]
    chunk_end, chunk = 70, 24
    width = -(-max(*lens, chunk_end) // BLOCK_SIZE)
    nb = 1 + 4 * width
    cache = make_layer_kv(spec, nb, kvh, hd, torch.device("cpu"), static_scales=(0.05, 0.03))
    tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(4)]
    for table, n in zip(tables, [*lens, chunk_end], strict=True):
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, kvh, hd, generator=g) * (1 + 2 * torch.rand(n, kvh, 1, generator=g))
        cache.write_ref(k, torch.randn(n, kvh, hd, generator=g), slots)
    for table, n in zip(tables, [*lens, chunk_end - chunk + 1], strict=True):  # given back: before the window
        for b in range(max(0, n - window) // BLOCK_SIZE):
            table[b] = 0
    spans = [SeqSpan(i, i + 1, n, tables[i][: -(-n // BLOCK_SIZE)]) for i, n in enumerate(lens)]
    prefill = SeqSpan(3, 3 + chunk, chunk_end, tables[3])
    batch = AttentionBatch(torch.zeros(3 + chunk, dtype=torch.long), spans, [prefill])
    return cache, build_torch_metadata(batch, torch.device("cpu")), 3 + chunk


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize(("window", "softcap"), [(20, None), (33, 2.5), (None, 1.5)])
@pytest.mark.parametrize(("kvh", "group", "hd"), [(2, 3, 64), (1, 4, 80)])
def test_window_and_softcap_match_torch(kind: str, window: int | None, softcap: float | None, kvh: int,
                                        group: int, hd: int) -> None:
    spec = SPECS[kind]
    cache, meta, rows = _case(spec, window or 10_000, kvh, hd)
    q = torch.randn(rows, kvh * group, hd, generator=torch.Generator().manual_seed(1)) * 3
    want = masked_attention(q, cache, meta, hd**-0.5, window, softcap)
    if kind == "fp32" and window is not None:
        cache.k[0], cache.v[0] = float("nan"), float("nan")  # the given-back blocks: never read
    got = CpuNativePagedAttention(spec).attend(q, q, q, cache, meta, hd**-0.5, window, softcap)
    assert rel_err(got, want) < 2e-6


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("window", [20, None])
def test_sinks_match_torch(kind: str, window: int | None) -> None:
    """Attention sinks (gpt-oss: one learned logit per head in each softmax), some above every
    score and some below, in every cache kind, against the torch reference's eager softmax."""
    spec = SPECS[kind]
    kvh, group, hd = 2, 3, 64
    cache, meta, rows = _case(spec, window or 10_000, kvh, hd)
    q = torch.randn(rows, kvh * group, hd, generator=torch.Generator().manual_seed(2)) * 3
    sinks = torch.tensor([-4.0, 0.0, 2.0, 6.0, 30.0, -30.0])
    want = masked_attention(q, cache, meta, hd**-0.5, window, None, sinks)
    got = CpuNativePagedAttention(spec).attend(q, q, q, cache, meta, hd**-0.5, window, None, sinks)
    assert rel_err(got, want) < 2e-6
    plain = masked_attention(q, cache, meta, hd**-0.5, window, None)
    assert rel_err(plain, want) > 0.1  # the sinks matter here
