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
The errors are computed from H = E[x x^T] of every calibration token (d H d^T for a weight
error d), so the searches see all tokens at the cost of one [in, in] matrix per input.
"""

from __future__ import annotations

import torch

from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


class InputRecorder:
    """What the searches need from a linear's inputs X: per-channel mean |x| and H = X^T X / n."""

    def __init__(self, n: int) -> None:
        self.abs_sum = torch.zeros(n, dtype=torch.float64)
        self.h = torch.zeros(n, n, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        self.abs_sum += x.abs().sum(0).double()
        xf = x.float().numpy()
        self.h += torch.from_numpy(xf.T @ xf).double()  # as calibrate._Hessian: fp32 products, fp64 sum
        self.count += x.shape[0]

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def hessian(self) -> torch.Tensor:
        return (self.h / max(self.count, 1)).float()


def output_error(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Mean squared output error per output channel of a weight error d [out, in]:
    mean over inputs x of (d x)^2 = d H d^T (diagonal), H = E[x x^T]."""
    return ((d @ h) * d).sum(1)


def fake_quant(w: torch.Tensor, bits: int, group_size: int | None, sym: bool) -> torch.Tensor:
    """Q(w) as floats: what the quantized checkpoint will compute with."""
    q, s, z = quantize_rtn(w, bits, group_size, sym)
    return dequantize_rtn(q, s, z, group_size)


def group_mean_abs_w(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Per-input-channel mean of |W| normalized by each group's max (AutoAWQ's w_mean)."""
    out_f, in_f = w.shape
    g = group_size or in_f
    groups = -(-in_f // g)
    pad = groups * g - in_f
    wa = torch.nn.functional.pad(w.abs(), (0, pad)).view(out_f, groups, g)
    wa = wa / wa.amax(dim=2, keepdim=True).clamp_min(1e-8)
    return wa.view(out_f, groups * g)[:, :in_f].mean(0)


def scale_candidates(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int = 20
                     ) -> list[tuple[float, torch.Tensor]]:
    """(a, s) for a on the grid: s = mean|x|^a / mean|W~|^(1-a), normalized so that
    sqrt(max s * min s) = 1."""
    out = []
    for i in range(n_grid):
        a = i / n_grid
        s = (x_mean.clamp_min(1e-8) ** a / w_mean.clamp_min(1e-8) ** (1 - a)).clamp_min(1e-4)
        out.append((a, s / (s.max() * s.min()).sqrt()))
    return out


def scaled_error(w: torch.Tensor, s: torch.Tensor | None, h: torch.Tensor, bits: int, group_size: int | None,
                 sym: bool) -> float:
    """Output error of Q(w s) / s against w [out, in] (of plain Q(w) where s is None) over
    inputs with H = E[x x^T]."""
    q = fake_quant(w, bits, group_size, sym) if s is None else fake_quant(w * s, bits, group_size, sym) / s
    return float(output_error(q - w, h).sum())


@torch.no_grad()
def search_scale(h: torch.Tensor, x_mean: torch.Tensor, w: torch.Tensor, bits: int, group_size: int | None,
                 sym: bool, n_grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scales for w [out, in] given the inputs' H = E[x x^T] [in, in] and
    mean |x| [in]. The output error of scales s is that of Q(w s) / s against w over every
    calibration token. Returns (scales [in], best ratio, error ratio best / plain RTN)."""
    plain = scaled_error(w, None, h, bits, group_size, sym)
    best = (plain, torch.ones_like(x_mean), -1.0)  # no scaling stays a candidate: never worse than RTN
    for a, s in scale_candidates(x_mean, group_mean_abs_w(w, group_size), n_grid):
        err = scaled_error(w, s, h, bits, group_size, sym)
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2], best[0] / max(plain, 1e-30)


@torch.no_grad()
def search_clip(h: torch.Tensor, w: torch.Tensor, bits: int, group_size: int | None, sym: bool,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """w [out, in] clipped per (output channel, group) to the range that minimizes that group's
    output error (H's diagonal block for the group; cross-group terms ignored, as AWQ does)."""
    out_f, in_f = w.shape
    g = group_size or in_f
    best_w = w.clone()
    for lo in range(0, in_f, g):
        wg, hg = w[:, lo : lo + g], h[lo : lo + g, lo : lo + g]
        amax = wg.abs().amax(dim=1, keepdim=True)
        best_err = torch.full((out_f,), float("inf"))
        for i in range(int(max_shrink * n_grid)):
            mx = amax * (1 - i / n_grid)
            cand = torch.maximum(torch.minimum(wg, mx), -mx)
            err = output_error(fake_quant(cand, bits, None, sym) - wg, hg)  # one group: per-row scale
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_w[better, lo : lo + g] = cand[better]
    return best_w
