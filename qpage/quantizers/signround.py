"""Sign-gradient rounding (SignRound, the method of Intel's AutoRound) for INT4/INT8.

Per decoder layer, once the layers before it are quantized:

- start from the importance-weighted grid of ``int*-imatrix`` (``rtn.quantize_rtn`` with the
  inputs' E[x^2]: a scale and zero per group);
- learn, for every weight, a rounding offset V in [-0.5, 0.5] and, per group, a scale factor f
  in [0.8, 1.2], by signed gradient steps (``1 / STEPS`` for V, a tenth of that for f) on the
  mean squared error between the layer's output with its quantized weights, on the quantized
  model's inputs, and the unquantized layer's output on the unquantized model's inputs;
  round() passes gradients straight through;
- keep the offsets of the step with the least loss (checked every ``CHECK_EVERY`` steps on a
  few windows), write the integers, and move both input streams on.

The layer runs as plain differentiable torch (``layer_forward``: the Llama family's layer,
biases and QK-norm included), checked against the engine's layer in the tests. Memory: the
calibration hidden states three times (quantized stream, unquantized stream, the layer's
targets) and one layer in fp32 with its offsets and their gradients. Time: ``STEPS`` forward
and backward passes of one window per layer, on top of imatrix's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qpage.formats.scheme import QuantScheme
from qpage.layers.rotary import apply_rotary
from qpage.models.arch import GEMMA_ARCHITECTURES
from qpage.models.llama import projections
from qpage.quantizers.layer_source import LayerSource, ResultStore
from qpage.quantizers.rtn import quantize_rtn

STEPS = 100
"""Signed gradient steps per layer, one calibration window each (in turn)."""
CHECK_EVERY = 10
"""Steps between checks of the loss on ``CHECK_WINDOWS`` windows; the best offsets are kept."""
CHECK_WINDOWS = 4
FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The layer's linears, as the engine fuses them (q/k/v and gate/up share an input)."""


@dataclass
class LayerParams:
    """A decoder layer's tensors for ``layer_forward`` (fp32): fused weights [out, in] and
    biases by name in ``FUSED`` (None: no bias), the two norms, the QK norms (None: none)."""

    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor | None]
    norms: tuple[torch.Tensor, torch.Tensor]
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, layer: Any) -> LayerParams:
        mods = {k: layer.get_submodule(k) for k in FUSED}
        attn = layer.self_attn
        qk = (attn.q_norm.weight.data.clone(), attn.k_norm.weight.data.clone()) if attn.q_norm is not None else None
        return cls({k: m.weight.data.clone() for k, m in mods.items()},
                   {k: None if m.bias is None else m.bias.data.clone() for k, m in mods.items()},
                   (layer.input_layernorm.weight.data.clone(), layer.post_attention_layernorm.weight.data.clone()), qk)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def layer_forward(x: torch.Tensor, p: LayerParams, cos: torch.Tensor, sin: torch.Tensor, c: Any,
                  weights: dict[str, torch.Tensor] | None = None,
                  record: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One decoder layer on one window x [T, hidden] (causal attention from position 0),
    differentiable in ``weights`` (default: ``p.weights``). ``record``: sums of each fused
    linear's squared inputs over the rows are added to it."""
    ws = weights or p.weights

    def linear(name: str, a: torch.Tensor) -> torch.Tensor:
        if record is not None:
            record[name] = record.get(name, 0) + a.detach().square().sum(0)
        b = p.biases[name]
        return a @ ws[name].t() if b is None else torch.addmm(b, a, ws[name].t())

    t, nq, nkv, hd = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    qkv = linear("self_attn.qkv_proj", _rms(x, p.norms[0], c.rms_norm_eps)).view(t, nq + 2 * nkv, hd)
    q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
    if p.qk_norms is not None:
        q, k = _rms(q, p.qk_norms[0], c.rms_norm_eps), _rms(k, p.qk_norms[1], c.rms_norm_eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rep = nq // nkv
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
    x = x + linear("self_attn.o_proj", att.transpose(0, 1).reshape(t, nq * hd))
    gu = linear("mlp.gate_up_proj", _rms(x, p.norms[1], c.rms_norm_eps))
    inter = gu.shape[-1] // 2
    return x + linear("mlp.down_proj", F.silu(gu[:, :inter]) * gu[:, inter:])


class Rounding:
    """One weight [out, in] on a ``bits`` grid of ``g`` inputs per group, with learnt rounding
    offsets V [out, groups, g] and scale factors f [out, groups, 1] around the imatrix grid."""

    def __init__(self, w: torch.Tensor, importance: torch.Tensor, bits: int, g: int, sym: bool) -> None:
        self.out_f, self.in_f = w.shape
        self.top = float(2**bits - 1)
        groups = -(-self.in_f // g)
        _, s, z = quantize_rtn(w, bits, g, sym, importance=importance)
        self.s, self.z = s.t()[..., None], z.t().float()[..., None]  # [out, groups, 1]
        self.w = F.pad(w.float(), (0, groups * g - self.in_f)).view(self.out_f, groups, g)
        self.v = torch.zeros_like(self.w, requires_grad=True)
        self.f = torch.ones_like(self.s, requires_grad=True)

    def weight(self) -> torch.Tensor:
        """The quantized weight [out, in], differentiable in V and f."""
        s = self.s * self.f
        x = self.w / s + self.v
        q = (x + (x.round() - x).detach() + self.z).clamp(0, self.top)
        return ((q - self.z) * s).view(self.out_f, -1)[:, : self.in_f]

    def step(self, lr: float) -> None:
        with torch.no_grad():
            assert self.v.grad is not None and self.f.grad is not None
            self.v.sub_(lr * self.v.grad.sign()).clamp_(-0.5, 0.5)
            self.f.sub_(0.1 * lr * self.f.grad.sign()).clamp_(0.8, 1.2)
            self.v.grad, self.f.grad = None, None

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.v.detach().clone(), self.f.detach().clone()

    def load(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        with torch.no_grad():
            self.v.copy_(state[0])
            self.f.copy_(state[1])

    @torch.no_grad()
    def result(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """((q [in, out] uint8, scales fp32 holding fp16 [groups, out], zeros int32 [groups, out]),
        the weight [out, in] they dequantize to)."""
        s = (self.s * self.f).half().float()  # the scales as stored
        q = (self.w / s + self.v).round().add(self.z).clamp(0, self.top)
        w = ((q - self.z) * s).view(self.out_f, -1)[:, : self.in_f]
        q = q.view(self.out_f, -1)[:, : self.in_f]
        return (q.t().to(torch.uint8), s[..., 0].t().contiguous(), self.z[..., 0].t().to(torch.int32).contiguous()), w


def signround_calibrate(src: Path, scheme: QuantScheme, windows: list[list[int]], store: ResultStore,
                        on_layer: Callable[[int, int], None] | None = None, steps: int = STEPS,
                        losses: list[tuple[float, float]] | None = None) -> ResultStore:
    """Every decoder linear of ``src`` by sign-gradient rounding, into ``store`` (prefix ->
    (q, scales, zeros, None)). ``losses``: each layer's (loss on the imatrix grid, loss kept)."""
    source = LayerSource(src, max(len(w) for w in windows) + 1)
    model, c = source.model, source.arch
    parts: dict[str, list[tuple[str, int, int]]] = {}
    for name, fused, off, rows in projections(c):
        parts.setdefault(fused, []).append((name, off, rows))
    if set(parts) != set(FUSED) or c.architecture in GEMMA_ARCHITECTURES or c.num_experts:
        raise ValueError(f"sign-gradient rounding runs the Llama family's layer, not {c.architecture}'s; "
                         "use gptq or rtn")
    h_fp = source.embed(windows)
    h_q = [h.clone() for h in h_fp]
    cos, sin = model.rotary.lookup(torch.arange(max(len(w) for w in windows)))
    for li in range(c.num_layers):
        p = LayerParams.of(source.layer(li))
        out, layer_losses = _layer(p, h_fp, h_q, cos, sin, c, scheme, steps, parts, f"model.layers.{li}.")
        store.put_layer(li, out)
        if losses is not None:
            losses.append(layer_losses)
        if on_layer is not None:
            on_layer(li + 1, c.num_layers)
    return store


def _layer(p: LayerParams, h_fp: list[torch.Tensor], h_q: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
           c: Any, scheme: QuantScheme, steps: int, parts: dict[str, list[tuple[str, int, int]]], pre: str
           ) -> tuple[dict[str, Any], tuple[float, float]]:
    """One layer: its results by prefix, and (loss before, loss after). Updates h_fp and h_q
    in place to the next layer's inputs."""
    def fwd(x: torch.Tensor, **kw: Any) -> torch.Tensor:
        t = x.shape[0]
        return layer_forward(x, p, cos[:t], sin[:t], c, **kw)

    with torch.no_grad():
        target = [fwd(h) for h in h_fp]
        sums: dict[str, torch.Tensor] = {}
        for h in h_q:
            fwd(h, record=sums)
    rows = sum(h.shape[0] for h in h_q)
    rounding = {k: Rounding(p.weights[k], sums[k] / rows, scheme.bits, scheme.group_size or p.weights[k].shape[1],
                            scheme.sym) for k in FUSED}

    def loss(idx: range | list[int]) -> torch.Tensor:
        wq = {k: r.weight() for k, r in rounding.items()}
        return sum(F.mse_loss(fwd(h_q[i], weights=wq), target[i]) for i in idx) / len(idx)  # type: ignore[return-value]

    check = range(min(len(h_q), CHECK_WINDOWS))
    with torch.no_grad():
        best = first = float(loss(check))
    kept = {k: r.state() for k, r in rounding.items()}
    for step in range(steps):
        loss([step % len(h_q)]).backward()
        for r in rounding.values():
            r.step(1.0 / steps)
        if (step + 1) % CHECK_EVERY == 0 or step == steps - 1:
            with torch.no_grad():
                now = float(loss(check))
            if now < best:
                best, kept = now, {k: r.state() for k, r in rounding.items()}
    out: dict[str, Any] = {}
    wq: dict[str, torch.Tensor] = {}
    for k, r in rounding.items():
        r.load(kept[k])
        (q, s, z), wq[k] = r.result()
        for name, off, n in parts[k]:
            out[pre + name] = (q[:, off : off + n].contiguous(), s[:, off : off + n].contiguous(),
                               z[:, off : off + n].contiguous(), None)
    with torch.no_grad():
        h_q[:] = [fwd(h, weights=wq) for h in h_q]
        h_fp[:] = target
    return out, (first, best)
