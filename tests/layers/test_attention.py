"""Paged attention backends against dense attention computed per sequence.

The torch (SDPA) path, the CPU-BLAS path, the C kernels and the Triton kernels (interpreter),
each building its own metadata from the same batch, on a randomly filled paged cache with
shuffled block tables: decodes that group into one padded group of two rows and a one-row
group, prefill chunks with and without cached context. fp32; tolerance 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu import native
from qpage.layers.attention.backends import CpuBlasPagedAttention, CpuNativePagedAttention, TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, LayerKV
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan, decode_groups
from qpage.layers.attention.triton_backend import TritonPagedAttention

KVH, G, HD = 2, 3, 16
H = KVH * G


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, HD] at positions start.., k/v [start+T, KVH, HD]: plain causal softmax attention."""
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = torch.einsum("thd,chd->htc", q, k) / HD**0.5
    t, c = q.shape[0], k.shape[0]
    allowed = torch.arange(c)[None, :] <= (start + torch.arange(t))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htc,chd->thd", s.softmax(-1), v)


@pytest.mark.parametrize("backend", [b(KVCacheSpec(torch.float32)) for b in (
    TorchPagedAttention, CpuBlasPagedAttention, CpuNativePagedAttention, TritonPagedAttention)], ids=lambda b: b.name)
def test_paged_attention_matches_dense(backend: TorchPagedAttention) -> None:
    if backend.name == "cpu-native" and native.unavailable_reason():
        pytest.skip(f"C kernels: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    nblocks = 64
    k_cache = torch.randn(nblocks + 8, BLOCK_SIZE, KVH, HD, generator=g)
    v_cache = torch.randn(nblocks + 8, BLOCK_SIZE, KVH, HD, generator=g)
    perm = torch.randperm(nblocks, generator=g).tolist()
    # (context length after this step, new tokens): 3 decodes, 2 prefills (one with context).
    seqs = [(150, 1), (140, 1), (37, 1), (200, 90), (45, 45)]
    tables, q_rows, want = [], [], []
    for i, (ctx, new) in enumerate(seqs):
        nb = -(-ctx // BLOCK_SIZE)
        # Row 2 (a one-row decode group) gets consecutive blocks: the gather-free view path.
        ids = list(range(nblocks + 2, nblocks + 2 + nb)) if i == 2 else [perm.pop() for _ in range(nb)]
        tables.append(torch.tensor(ids))
        kd = k_cache[tables[-1]].reshape(-1, KVH, HD)[:ctx]
        vd = v_cache[tables[-1]].reshape(-1, KVH, HD)[:ctx]
        q = torch.randn(new, H, HD, generator=g)
        q_rows.append(q)
        want.append(dense(q, kd, vd, ctx - new))
    q_all = torch.cat(q_rows)
    decodes = [SeqSpan(i, i + 1, seqs[i][0], tables[i].tolist()) for i in range(3)]
    assert decode_groups(decodes) == [(0, 2), (2, 3)]  # 2 rows (padded), 1 row (consecutive blocks)
    prefills, row = [], 3
    fresh_k = torch.zeros(len(q_all), KVH, HD)
    fresh_v = torch.zeros(len(q_all), KVH, HD)
    for i in (3, 4):
        ctx, new = seqs[i]
        if ctx == new:  # no context: the backend reads this chunk's own K/V, as written this step
            fresh_k[row : row + new] = k_cache[tables[i]].reshape(-1, KVH, HD)[:ctx]
            fresh_v[row : row + new] = v_cache[tables[i]].reshape(-1, KVH, HD)[:ctx]
        prefills.append(SeqSpan(row, row + new, ctx, tables[i].tolist()))
        row += new
    batch = AttentionBatch(torch.empty(0, dtype=torch.long), decodes, prefills)
    meta = backend.build_metadata(batch, torch.device("cpu"))
    got = backend.attend(q_all, fresh_k, fresh_v, LayerKV(k_cache, v_cache), meta, HD**-0.5)
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=0)


def test_write_cache_slots() -> None:
    k_cache = torch.zeros(4, BLOCK_SIZE, KVH, HD)
    v_cache = torch.zeros(4, BLOCK_SIZE, KVH, HD)
    k = torch.randn(3, KVH, HD)
    v = torch.randn(3, KVH, HD)
    backend = TorchPagedAttention(KVCacheSpec(torch.float32))
    backend.write_cache(k, v, LayerKV(k_cache, v_cache), torch.tensor([5, 17, 63]))
    assert torch.equal(k_cache[0, 5], k[0]) and torch.equal(k_cache[1, 1], k[1])
    assert torch.equal(v_cache[3, 15], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
