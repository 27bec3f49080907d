"""AWQ: activation-aware per-input-channel scales, searched on the layer's output error.

For each group of linears that share an input (q/k/v after the input norm, gate/up after the
post-attention norm, down after up; o after v only without GQA), with calibration inputs X:
1. scale search: s = mean|X|^a / mean|W~|^(1-a) (W~: weights normalized per group), normalized
   so that sqrt(max s * min s) = 1, for a on a grid over [0, 1); pick the a whose
   ``(X/s) @ Q(W*s)^T`` is closest (MSE) to ``X @ W^T``;
2. fold: the previous op's output is divided by s (RMSNorm weight or the previous linear's
   rows), the linear's input columns are multiplied by s, so the float model is unchanged;
3. clip search (optional): per output channel and group, shrink the quantization range to
   the ratio in [0.5, 1] that minimizes that group's share of the output error;
4. RTN with the usual GPTQ-compatible scale/zero convention.
X is subsampled (``max_tokens`` rows, fixed seed) for the searches; mean|X| uses every row.
"""

from __future__ import annotations

import torch

from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


class InputRecorder:
    """Per-channel mean |x| over all rows and a reservoir of up to ``max_tokens`` rows."""

    def __init__(self, n: int, max_tokens: int, seed: int = 0) -> None:
        self.abs_sum = torch.zeros(n, dtype=torch.float64)
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.max_tokens = max_tokens
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.abs_sum += x.abs().sum(0).double()
        self.count += x.shape[0]
        self.rows.append(x.clone())
        kept = sum(r.shape[0] for r in self.rows)
        if kept > 2 * self.max_tokens:  # keep memory bounded: subsample what we hold
            self.rows = [self.sample()]

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def sample(self) -> torch.Tensor:
        x = torch.cat(self.rows)
        if x.shape[0] <= self.max_tokens:
            return x
        idx = torch.randperm(x.shape[0], generator=self.gen)[: self.max_tokens]
        return x[idx.sort().values]


def fake_quant(w: torch.Tensor, bits: int, group_size: int | None, sym: bool) -> torch.Tensor:
    """Q(w) as floats: what the quantized checkpoint will compute with."""
    q, s, z = quantize_rtn(w, bits, group_size, sym)
    return dequantize_rtn(q, s, z, group_size)


def _group_mean_abs_w(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Per-input-channel mean of |W| normalized by each group's max (AutoAWQ's w_mean)."""
    out_f, in_f = w.shape
    g = group_size or in_f
    groups = -(-in_f // g)
    pad = groups * g - in_f
    wa = torch.nn.functional.pad(w.abs(), (0, pad)).view(out_f, groups, g)
    wa = wa / wa.amax(dim=2, keepdim=True).clamp_min(1e-8)
    return wa.view(out_f, groups * g)[:, :in_f].mean(0)


@torch.no_grad()
def search_scale(x: torch.Tensor, x_mean: torch.Tensor, w: torch.Tensor, bits: int, group_size: int | None,
                 sym: bool, n_grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scales for w [out, in] given inputs x [T, in].
    Returns (scales [in], best ratio, error ratio best/plain-RTN)."""
    ref = x @ w.t()
    w_mean = _group_mean_abs_w(w, group_size)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    plain = None
    for i in range(n_grid):
        a = i / n_grid
        s = (x_mean.clamp_min(1e-8) ** a / w_mean.clamp_min(1e-8) ** (1 - a)).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = float(((x / s) @ fake_quant(w * s, bits, group_size, sym).t() - ref).pow(2).mean())
        if i == 0:
            plain = float((x @ fake_quant(w, bits, group_size, sym).t() - ref).pow(2).mean())
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2], best[0] / max(plain or best[0], 1e-30)


@torch.no_grad()
def search_clip(x: torch.Tensor, w: torch.Tensor, bits: int, group_size: int | None, sym: bool,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """w [out, in] clipped per (output channel, group) to the range that minimizes the group's
    output error on x [T, in]."""
    out_f, in_f = w.shape
    g = group_size or in_f
    best_w = w.clone()
    for lo in range(0, in_f, g):
        xg, wg = x[:, lo : lo + g], w[:, lo : lo + g]
        ref = xg @ wg.t()  # [T, out]
        amax = wg.abs().amax(dim=1, keepdim=True)
        best_err = torch.full((out_f,), float("inf"))
        for i in range(int(max_shrink * n_grid)):
            mx = amax * (1 - i / n_grid)
            cand = torch.maximum(torch.minimum(wg, mx), -mx)
            qg = fake_quant(cand, bits, None, sym)  # one group: per-row scale over these columns
            err = (xg @ qg.t() - ref).pow(2).mean(0)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_w[better, lo : lo + g] = cand[better]
    return best_w
