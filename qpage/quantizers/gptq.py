"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

H = 2/n X X^T over the calibration inputs X [in, n]; ``DAMP`` (10%) of the mean diagonal is
added as dampening (more than the usual 1%: it measured best on text unlike the calibration
text, which less damping fits too closely); the upper Cholesky factor of H^-1 drives the
updates, in blocks of 128 columns (lazy batch updates). Optional act-order quantizes columns by decreasing diag(H) and
records the grouping in ``g_idx``; group scales/zeros follow ``quantizers.rtn``'s
conventions (its importance-weighted search by default, with diag(H) as the importance), on
the not-yet-quantized, error-updated columns as each group starts, or on the original
weights up front (``static_groups``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qpage.quantizers.ggml_blocks import GRIDS, BlockGrid, block_grid, codes, pack
from qpage.quantizers.rtn import group_params

BLOCK = 128
DAMP = 0.1


def _inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the upper Cholesky factor of the dampened H^-1, the inputs never seen), H in fp64."""
    h = h.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float(), dead


def _feedback(w: torch.Tensor, hinv: torch.Tensor,
              quantize_column: Callable[[int, torch.Tensor, Callable[[], torch.Tensor]], torch.Tensor]) -> None:
    """GPTQ's loop over the columns of w [out, in] (in place): ``quantize_column(col, x,
    upcoming)`` rounds column ``col`` (values x) and returns what it dequantizes to;
    ``upcoming()`` gives the error-updated columns from ``col`` on, for grids chosen as a
    group starts. The rounding error goes onto later columns, within blocks of ``BLOCK``
    columns at once and onto the rest once per block (lazy batch updates)."""
    in_f = w.shape[1]
    for b0 in range(0, in_f, BLOCK):
        b1 = min(b0 + BLOCK, in_f)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            x = w1[:, i]
            deq = quantize_column(b0 + i, x, lambda i=i, w1=w1, b1=b1: torch.cat([w1[:, i:], w[:, b1:]], dim=1))
            e = (x - deq) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]


def gptq_ggml(w: torch.Tensor, h: torch.Tensor, ggml_type: int, damp: float = DAMP) -> np.ndarray:
    """GPTQ into a llama.cpp block format: w [out, in], h [in, in] -> the format's bytes
    [out, in / block * block bytes]. Each block's grid comes from ``ggml_blocks.block_grid``
    (importance diag(H)) on the error-updated columns as the block starts; columns keep
    their order (a GGUF has no g_idx)."""
    g = GRIDS[ggml_type]
    w = w.clone().float()
    out_f, in_f = w.shape
    importance = torch.diag(h).float() + 1e-12
    hinv, dead = _inverse_factor(h, damp)
    w[:, dead] = 0
    q = torch.zeros(out_f, in_f)
    grids: list[BlockGrid] = []

    def column(col: int, x: torch.Tensor, upcoming: Callable[[], torch.Tensor]) -> torch.Tensor:
        if col % g.block == 0:
            cols = upcoming()[:, : g.block]
            grids.append(block_grid(cols, importance[col : col + g.block].expand_as(cols), ggml_type))
        sub = col % g.block // g.sub
        s, m = grids[-1].s[:, sub], grids[-1].m[:, sub]
        q[:, col] = codes(x[:, None], s, m, g)[:, 0]
        return q[:, col] * s + m

    _feedback(w, hinv, column)
    nb = in_f // g.block
    stored = tuple(torch.stack([gr.stored[k] for gr in grids], 1).reshape(out_f * nb, *grids[0].stored[k].shape[1:])
                   for k in range(len(grids[0].stored)))
    blocks = pack(q.view(out_f * nb, g.block), BlockGrid(torch.empty(0), torch.empty(0), stored), ggml_type)
    return blocks.reshape(out_f, -1)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None, sym: bool,
                  act_order: bool = False, damp: float = DAMP, static_groups: bool = False,
                  search: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [out, in], h [in, in] -> (q int32 [in, out], scales [G, out], zeros int32 [G, out], g_idx or None).
    ``search``: each group's scale and zero from the importance-weighted search of
    ``rtn.group_params`` (importance diag(H)) instead of the group's min and max."""
    w = w.clone().float()
    out_f, in_f = w.shape
    g = group_size or in_f
    groups = -(-in_f // g)
    maxq = 2**bits - 1
    h = h.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    diag = torch.diag(h).float()  # E[x^2] per input (x2): the group search's importance
    perm = torch.argsort(diag, descending=True) if act_order else torch.arange(in_f)
    scales = torch.zeros(groups, out_f)
    zeros = torch.zeros(groups, out_f)
    if static_groups:
        for gi in range(groups):
            cols = slice(gi * g, (gi + 1) * g)
            scales[gi], zeros[gi] = group_params(w[:, cols], bits, sym, diag[cols] if search else None)
    w = w[:, perm]
    hinv, _ = _inverse_factor(h[perm][:, perm], damp)
    q = torch.zeros(out_f, in_f)

    def column(col: int, x: torch.Tensor, upcoming: Callable[[], torch.Tensor]) -> torch.Tensor:
        # col: the position in quantization order
        grp = int(perm[col]) // g if static_groups else col // g
        if not static_groups and col % g == 0:
            scales[grp], zeros[grp] = group_params(upcoming()[:, :g], bits, sym,
                                                   diag[perm[col : col + g]] if search else None)
        s, z = scales[grp], zeros[grp]
        q[:, col] = torch.clamp(torch.round(x / s) + z, 0, maxq)
        return (q[:, col] - z) * s

    _feedback(w, hinv, column)
    inv = torch.argsort(perm)
    q = q[:, inv]
    # Act-order without static groups forms groups in quantization order: record them.
    g_idx = inv // g if act_order and not static_groups else torch.arange(in_f) // g
    default = torch.equal(g_idx, torch.arange(in_f) // g)
    return (q.t().contiguous().to(torch.int32), scales, zeros.to(torch.int32),
            None if default else g_idx.to(torch.int32))
