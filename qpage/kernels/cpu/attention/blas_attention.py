"""Paged attention for fp32 on CPU, with its matmuls on NumPy's BLAS.

Why not SDPA: with torch on one thread (``qpage.layers.ops``), SDPA over gathered paged K/V
is slow for batched decode and prefill, and torch's bmm with a skinny right-hand side (the
decode case) is several times slower than OpenBLAS's (docs/cpu.md). These paths gather K/V
once per layer (``gather_blocks``) and give every matmul to OpenBLAS.

Cache layout (as ``qpage.layers.attention.backends``): ``[num_blocks, BLOCK, kvh, hd]`` per layer.

Decode (one query token per sequence, n sequences batched): K of one sequence viewed as
``[L, kvh*hd]`` is multiplied by a block-diagonal query matrix ``[kvh*hd, H]`` whose
column j holds query head j in the rows of its kv head (j // group). One contiguous GEMM
per sequence gives all heads' scores ``[L, H]``; the zero blocks cost kvh-times the flops
of the exact product, which is negligible next to reading K (decode is memory bound).
The output ``P^T V`` is ``[H, kvh*hd]``, of which head j keeps its own kv head's block.

Prefill (a chunk of T new tokens after ``start`` cached ones): per kv head, the group's
queries are stacked (``[T*group, hd]``) and processed in row tiles; tile [a, b) only
multiplies against the keys it can see (positions < start + b), so the causal upper
triangle is mostly skipped.
"""

from __future__ import annotations

import numpy as np
import torch

_TILE = 128


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [n, H, hd]; keys/values [n, L, kvh, hd] (gathered); bias [n, L, 1] (0 or -inf).

    Returns [n, H, hd].
    """
    n, h, hd = q.shape
    L, kvh = keys.shape[1], keys.shape[2]
    g = h // kvh
    qb = torch.zeros(n, kvh, hd, kvh, g, dtype=q.dtype)
    # qb[s, k, :, k, j] = q[s, k*g + j, :]
    qb.diagonal(dim1=1, dim2=3).copy_(q.view(n, kvh, g, hd).permute(0, 3, 2, 1))
    scores = torch.from_numpy(np.matmul(_np(keys.reshape(n, L, kvh * hd)), _np(qb.view(n, kvh * hd, h))))
    scores.mul_(scale).add_(bias)
    # Softmax along a contiguous last axis is several times faster than along axis 1.
    probs = torch.softmax(scores.transpose(1, 2).contiguous(), dim=-1)  # [n, H, L]
    out = torch.from_numpy(np.matmul(_np(probs), _np(values.reshape(n, L, kvh * hd))))  # [n, H, kvh*hd]
    return out.view(n, kvh, g, kvh, hd).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, h, hd)


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [T, H, hd] for positions start..start+T-1; keys/values [C, kvh, hd] with C = start + T
    (the cached context followed by this chunk). Causal. Returns [T, H, hd]."""
    t, h, hd = q.shape
    c, kvh = keys.shape[0], keys.shape[1]
    g, start = h // kvh, c - t
    qs = _np(q.view(t, kvh, g, hd).permute(1, 0, 2, 3).contiguous().view(kvh, t * g, hd))
    kt = _np(keys.permute(1, 2, 0).contiguous())  # [kvh, hd, C]
    vs = _np(values.permute(1, 0, 2).contiguous())  # [kvh, C, hd]
    out = np.empty((kvh, t * g, hd), dtype=qs.dtype)
    tri = torch.full((_TILE, _TILE), float("-inf"), dtype=q.dtype).triu_(1)
    for a in range(0, t, _TILE):
        b = min(a + _TILE, t)
        end = start + b  # keys visible to the tile's last row
        s = torch.from_numpy(np.matmul(qs[:, a * g : b * g], kt[:, :, :end]))  # [kvh, (b-a)*g, end]
        s.mul_(scale)
        # Rows are (token, group member); token i of the tile sees keys < start + a + i + 1.
        s.view(kvh, b - a, g, end)[..., start + a :].add_(tri[: b - a, None, : b - a])
        p = torch.softmax(s, dim=-1)
        out[:, a * g : b * g] = np.matmul(_np(p), vs[:, :end])
    return torch.from_numpy(out).view(kvh, t, g, hd).permute(1, 0, 2, 3).reshape(t, h, hd)
