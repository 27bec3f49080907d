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

import torch

from qpage.quantizers.rtn import group_params

BLOCK = 128
DAMP = 0.1


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
    h = h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_f, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(out_f, in_f)
    for b0 in range(0, in_f, BLOCK):
        b1 = min(b0 + BLOCK, in_f)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i  # position in quantization order
            grp = int(perm[col]) // g if static_groups else col // g
            if not static_groups and col % g == 0:
                cols = slice(col, col + g)
                scales[grp], zeros[grp] = group_params(torch.cat([w1[:, i:], w[:, b1:]], dim=1)[:, :g], bits, sym,
                                                       diag[perm[cols]] if search else None)
            s, z = scales[grp], zeros[grp]
            x = w1[:, i]
            qi = torch.clamp(torch.round(x / s) + z, 0, maxq)
            q[:, col] = qi
            e = (x - (qi - z) * s) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    inv = torch.argsort(perm)
    q = q[:, inv]
    # Act-order without static groups forms groups in quantization order: record them.
    g_idx = inv // g if act_order and not static_groups else torch.arange(in_f) // g
    default = torch.equal(g_idx, torch.arange(in_f) // g)
    return (q.t().contiguous().to(torch.int32), scales, zeros.to(torch.int32),
            None if default else g_idx.to(torch.int32))
