"""Round-to-nearest integer quantization of one weight matrix, group by group.

Conventions follow GPTQ's quantizer, so the result is stored as-is in the GPTQ format:
q in [0, 2**bits - 1], W ~= scale * (q - zero).
- symmetric: zero = 2**(bits-1), scale = 2 * amax / (2**bits - 1) (the largest magnitude
  maps to the top of the range; the grid is the same on both sides);
- asymmetric: scale = (max - min) / (2**bits - 1), zero = round(-min / scale), with the
  group's range widened to include 0. Zeros are kept >= 1 so GPTQ format v1 (which stores
  zero - 1) can hold them without overflowing into the neighbouring nibble.
"""

from __future__ import annotations

import torch


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None, sym: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int32 [in, out], scales fp32 [groups, out], zeros int32 [groups, out])."""
    out_f, in_f = w.shape
    g = group_size or in_f
    groups = -(-in_f // g)
    maxq = 2**bits - 1
    wt = w.t().float()  # [in, out]
    pad = groups * g - in_f
    wg = torch.nn.functional.pad(wt, (0, 0, 0, pad)).view(groups, g, out_f)
    rows_valid = (torch.arange(groups * g) < in_f).view(groups, g, 1)
    hi = wg.masked_fill(~rows_valid, float("-inf")).amax(1).clamp_min(0)
    lo = wg.masked_fill(~rows_valid, float("inf")).amin(1).clamp_max(0)
    if sym:
        amax = torch.maximum(hi, -lo)
        scale = (2 * amax / maxq).clamp_min(1e-10)
        zero = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
    else:
        scale = ((hi - lo) / maxq).clamp_min(1e-10)
        zero = torch.round(-lo / scale).clamp(1, maxq).to(torch.int32)
    scale = scale.half().float()  # stored as fp16: quantize against the stored value
    q = torch.clamp(torch.round(wg / scale[:, None, :]) + zero[:, None, :], 0, maxq).to(torch.int32)
    return q.view(groups * g, out_f)[:in_f].contiguous(), scale, zero


def dequantize_rtn(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int | None
                   ) -> torch.Tensor:
    """The [out, in] float weight that (q [in, out], scale, zero) encode."""
    in_f = q.shape[0]
    grp = torch.arange(in_f) // (group_size or in_f)
    return ((q - zero[grp]).float() * scale[grp]).t()
