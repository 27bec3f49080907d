"""Round-to-nearest integer quantization of one weight matrix, group by group.

Conventions follow GPTQ's quantizer, so the result is stored as-is in the GPTQ format:
q in [0, 2**bits - 1], W ~= scale * (q - zero).
- symmetric: zero = 2**(bits-1), scale = 2 * amax / (2**bits - 1) (the largest magnitude
  maps to the top of the range; the grid is the same on both sides);
- asymmetric: scale = (max - min) / (2**bits - 1), zero = round(-min / scale), with the
  group's range widened to include 0. Zeros are kept >= 1 so GPTQ format v1 (which stores
  zero - 1) can hold them without overflowing into the neighbouring nibble.

With an ``importance`` per input channel (E[x^2] of the layer's calibration inputs, what
llama.cpp's importance matrix holds), each group's scale and zero are searched instead:
candidate grids slightly narrower and wider than the group's range, each refitted by
weighted least squares, keeping the one with the least importance-weighted squared error
(the plain grid is a candidate, so the search never does worse on that error). Weighting by
the inputs matters: unweighted error search measures worse than plain rounding.

Groups run along the input axis of the [out, in] weight, so the work is done in that
layout (each group contiguous) and transposed once at the end.
"""

from __future__ import annotations

import torch

SEARCH_STEPS = 20
"""Candidate grids per group: widths from (2**bits - 2) to 2**bits steps over the range."""
_CHUNK = 1 << 22
"""Group rows searched at once (elements), bounding the search's temporaries."""
_CODE_CHUNK = 1 << 19
"""Elements rounded at once."""


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None, sym: bool,
                 importance: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [in, out] uint8 (a transposed view), scales fp32 [groups, out],
    zeros int32 [groups, out]); ``importance`` [in] turns on the weighted search."""
    out_f, in_f = w.shape
    g = group_size or in_f
    groups = -(-in_f // g)
    x = w.float()
    if groups * g != in_f:  # zero padding: inside every range already, and weight 0 below
        x = torch.nn.functional.pad(x, (0, groups * g - in_f))
    x = x.reshape(out_f * groups, g)
    imp = None
    if importance is not None:
        imp = torch.nn.functional.pad(importance.float().clamp_min(0), (0, groups * g - in_f)).view(groups, g)
    scale, zero = group_params(x, bits, sym, imp)
    q = codes(x, scale, zero, bits).view(out_f, groups * g)[:, :in_f]
    return q.t(), scale.view(out_f, groups).t().contiguous(), zero.view(out_f, groups).t().to(torch.int32)


def group_params(x: torch.Tensor, bits: int, sym: bool, importance: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp32 holding fp16 values) and zero (fp32 holding integers) of each row of
    x [rows, g]; ``importance`` [g] for every row, or [G, g] cycling over consecutive rows
    (row r uses importance[r % G]: the [out * G, g] layout of ``quantize_rtn``)."""
    if importance is None:
        return _plain(x, bits, sym)
    imp = importance.view(-1, x.shape[1])
    per = max(1, _CHUNK // x.shape[1] // imp.shape[0]) * imp.shape[0]  # whole cycles per chunk
    parts = [_search(x[r : r + per], bits, sym, imp) for r in range(0, x.shape[0], per)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of x [rows, g] on each row's grid, a few hundred KiB of rows at a time so
    the element-wise passes run in cache (about four times faster than whole-tensor passes)."""
    out = torch.empty(x.shape, dtype=torch.uint8)
    step = max(1, _CODE_CHUNK // x.shape[1])
    for r in range(0, x.shape[0], step):
        c = slice(r, r + step)
        out[c] = torch.div(x[c], scale[c, None]).round_().add_(zero[c, None]).clamp_(0, 2**bits - 1)
    return out


def _plain(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    maxq = 2**bits - 1
    hi = x.amax(1).clamp_min_(0)
    lo = x.amin(1).clamp_max_(0)
    if sym:
        scale = (2 * torch.maximum(hi, -lo) / maxq).clamp_min_(1e-10)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        scale = ((hi - lo) / maxq).clamp_min_(1e-10)
        zero = torch.round(-lo / scale).clamp_(1, maxq)
    return scale.half().float(), zero  # stored as fp16: quantize against the stored value


def _search(x: torch.Tensor, bits: int, sym: bool, imp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted search over rows of x [rows, g], importance imp [G, g] cycling over rows."""
    maxq = 2**bits - 1
    wt = imp.repeat(x.shape[0] // imp.shape[0], 1)
    best_s, best_z = _plain(x, bits, sym)
    best_err = _error(x, wt, best_s, best_z, bits)
    hi, lo = x.amax(1).clamp_min(0), x.amin(1).clamp_max(0)
    sw, sx = wt.sum(1), (wt * x).sum(1)
    for i in range(SEARCH_STEPS + 1):
        steps = maxq - 1 + 2 * i / SEARCH_STEPS
        if sym:
            scale = (2 * torch.maximum(hi, -lo) / steps).clamp_min(1e-10)
            zero = torch.full_like(scale, 2 ** (bits - 1))
        else:  # codes on this grid, then the (scale, min) that fit them best; min <= 0
            lvl = torch.round((x - lo[:, None]) * (steps / (hi - lo).clamp_min(1e-10))[:, None]).clamp_(0, maxq)
            sl, sll, slx = (wt * lvl).sum(1), (wt * lvl * lvl).sum(1), (wt * lvl * x).sum(1)
            det = (sw * sll - sl * sl).clamp_min(1e-20)
            mn = ((sll * sx - sl * slx) / det).clamp_max(0)
            scale = torch.where(mn < 0, (sw * slx - sx * sl) / det, slx / sll.clamp_min(1e-20)).clamp_min(1e-10)
            zero = torch.round(-mn / scale).clamp_(1, maxq)
        # The scale that fits these codes best with the zero fixed, then the codes again.
        c = _centered(x, scale, zero, bits)
        scale = ((wt * c * x).sum(1) / (wt * c * c).sum(1).clamp_min(1e-20)).clamp_min(1e-10).half().float()
        err = _error(x, wt, scale, zero, bits)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, scale, best_s), torch.where(better, zero, best_z)
    return best_s, best_z


def _centered(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes minus zero (fp32) of x [rows, g] on each row's grid: the dequantized value / scale."""
    return torch.div(x, scale[:, None]).round_().add_(zero[:, None]).clamp_(0, 2**bits - 1).sub_(zero[:, None])


def _error(x: torch.Tensor, wt: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Importance-weighted squared error of each row on its grid."""
    return (wt * _centered(x, scale, zero, bits).mul_(scale[:, None]).sub_(x).square_()).sum(1)


def dequantize_rtn(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int | None
                   ) -> torch.Tensor:
    """The [out, in] float weight that (q [in, out], scale, zero) encode."""
    in_f = q.shape[0]
    grp = torch.arange(in_f) // (group_size or in_f)
    return ((q.to(torch.int32) - zero[grp]).float() * scale[grp]).t()
