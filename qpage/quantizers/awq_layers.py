"""AWQ over a checkpoint, decoder layer by decoder layer (the searches: ``awq``; the layer
loop, recording and memory bounds: ``calibrate``).

Dense layers: the inputs of every linear are recorded once, with the layer in float; the
scales are searched and folded (q/k/v into the input norm, gate/up into the post-attention
norm, down into up's rows, o into v's rows without GQA), then each linear is clipped and
rounded, and the windows go on through the quantized layer.

Sparse layers (a mixture of experts): every expert's gate/up reads the same normed input, so
they share one scale, folded into the post-attention norm; the router and the shared
expert's gate read that input too and absorb the scale exactly (their columns multiplied by
it; they stay float). It is searched on the summed output error of all experts, each over
the rows routed to it. Each expert's down then gets its own scale (folded into its up rows)
from its routed rows. Experts' statistics are recorded in passes within
``calibrate.HESSIAN_BUDGET``; an expert that saw fewer than ``calibrate.MIN_ROWS`` rows is
rounded (RTN) and counted. The shared scale is judged at gate/up's output, as AWQ judges every
linear, not at the block's output after routing weights, activation and down.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qpage.formats.scheme import QuantScheme
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.moe import SparseMoe
from qpage.models.arch import GEMMA_ARCHITECTURES
from qpage.quantizers.awq import (
    InputRecorder,
    group_mean_abs_w,
    scale_candidates,
    scaled_error,
    search_clip,
    search_scale,
)
from qpage.quantizers.calibrate import MIN_ROWS, fused_parts, passes, run_layer
from qpage.quantizers.layer_source import LayerSource, Result, ResultStore
from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


@torch.inference_mode()
def awq_calibrate(src: Path, scheme: QuantScheme, windows: list[list[int]], store: ResultStore,
                  clip: bool = True, on_layer: Callable[[int, int], None] | None = None,
                  ) -> tuple[ResultStore, dict[str, torch.Tensor]]:
    """AWQ every decoder linear of ``src``: (``store``: prefix -> (q, scales, zeros, None), and
    the float tensors that absorbed the scales (norms, routers), by checkpoint name)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrate.calibrate_layers: the matmuls run on NumPy's BLAS threads
    try:
        return _awq(src, scheme, windows, store, clip, on_layer)
    finally:
        torch.set_num_threads(threads)


class _Layer:
    """One decoder layer being quantized: its linears, results and the checkpoint's names."""

    def __init__(self, source: LayerSource, li: int, scheme: QuantScheme, clip: bool) -> None:
        self.source, self.li, self.scheme, self.clip = source, li, scheme, clip
        self.shell = source.shell(li)
        self.layer = source.layer(li)
        self.parts = fused_parts(self.shell.layer_projections(0))
        self.linears = {k: self.layer.get_submodule(k) for k in self.parts}
        self.pre = f"model.layers.{li}."
        self.out: dict[str, Result] = {}
        self.rewritten: dict[str, torch.Tensor] = {}
        self.fell_back: list[str] = []

    def record(self, modules: dict[str, Any], hidden: list[torch.Tensor], backend: Any) -> dict[str, InputRecorder]:
        rec = {k: InputRecorder(m.in_features if k in self.linears else m.gate.shape[1]) for k, m in modules.items()}
        run_layer(self.shell, self.layer, hidden, backend, self.source.arch, record=(modules, rec))  # type: ignore[arg-type]
        return rec

    def quantize(self, key: str, h: torch.Tensor | None, clip: bool) -> None:
        """Round fused linear ``key`` (clipped first where asked; importance from H's diagonal;
        plain RTN without H), keep its results and run on its dequantized weight."""
        bits, g, sym = self.scheme.bits, self.scheme.group_size, self.scheme.sym
        w = self.linears[key].weight.data
        if h is not None and clip:
            w.copy_(search_clip(h, w.clone(), bits, g, sym))
        q, s, z = quantize_rtn(w, bits, g, sym, importance=None if h is None else torch.diagonal(h))
        for name, off, rows in self.parts[key]:
            self.out[self.pre + name] = (q[:, off : off + rows].contiguous(), s[:, off : off + rows].contiguous(),
                                         z[:, off : off + rows].contiguous(), None)
        w.copy_(dequantize_rtn(q, s, z, g))

    def keep(self, name: str, t: torch.Tensor) -> None:
        """A float tensor of this layer that absorbed a scale, under its checkpoint name."""
        full = self.pre + name
        self.rewritten[self.source.stored.get(full, full)] = t.clone()


def _awq(src: Path, scheme: QuantScheme, windows: list[list[int]], store: ResultStore, clip: bool,
         on_layer: Callable[[int, int], None] | None) -> tuple[ResultStore, dict[str, torch.Tensor]]:
    source = LayerSource(src, max(len(w) for w in windows) + 1)
    c = source.arch
    if c.architecture in GEMMA_ARCHITECTURES:
        raise ValueError(f"{src}: AWQ folds its scales into the norm before each linear, and Gemma's norms scale "
                         "by 1 + w after a post-norm; quantize Gemma with gptq or rtn")
    backend = TorchPagedAttention(KVCacheSpec(torch.float32))
    hidden = source.embed(windows)
    rewritten: dict[str, torch.Tensor] = {}
    for li in range(c.num_layers):
        lay = _Layer(source, li, scheme, clip)
        moe = lay.layer.mlp if isinstance(lay.layer.mlp, SparseMoe) else None
        dense = [k for k in lay.linears if moe is None or not k.startswith(("mlp.experts.", "mlp.shared_expert."))]
        modules: dict[str, Any] = {k: lay.linears[k] for k in dense}
        if moe is not None:
            modules["mlp"] = moe  # its input: the router's, every expert's before routing
        rec = lay.record(modules, hidden, backend)
        hess = {k: r.hessian() for k, r in rec.items() if k in dense}
        for key, prev in _dense_plan(lay, moe is None):
            s = _fold(lay, key, search_scale(hess[key], rec[key].mean_abs(), lay.linears[key].weight.data,
                                             scheme.bits, scheme.group_size, scheme.sym)[0], *prev)
            hess[key] = hess[key] / (s[:, None] * s[None, :])  # the inputs are now x / s
        if moe is not None:
            x_mean = rec.pop("mlp").mean_abs()  # its H is not needed: free it before the experts' passes
            _experts(lay, moe, x_mean, hidden, backend)
        for key in dense:
            lay.quantize(key, hess[key], clip and key != "self_attn.qkv_proj")  # q/k feed a softmax: unclipped
        lay.keep("input_layernorm.weight", lay.layer.input_layernorm.weight.data)
        lay.keep("post_attention_layernorm.weight", lay.layer.post_attention_layernorm.weight.data)
        rewritten.update(lay.rewritten)
        store.rtn_fallbacks += lay.fell_back
        store.put_layer(li, lay.out)
        hidden = run_layer(lay.shell, lay.layer, hidden, backend, c, record=None)
        if on_layer is not None:
            on_layer(li + 1, c.num_layers)
    return store, rewritten


def _dense_plan(lay: _Layer, dense_mlp: bool) -> list[tuple[str, tuple[Any, ...]]]:
    """(fused linear, what absorbs 1/s: a norm weight, or rows of an earlier linear with their bias)."""
    c, layer, linears = lay.source.arch, lay.layer, lay.linears
    plan: list[tuple[str, tuple[Any, ...]]] = [("self_attn.qkv_proj", (layer.input_layernorm.weight.data,))]
    if dense_mlp:
        inter = c.intermediate_size
        plan += [("mlp.gate_up_proj", (layer.post_attention_layernorm.weight.data,)),
                 ("mlp.down_proj", _rows(linears["mlp.gate_up_proj"], inter, 2 * inter, "mlp.up_proj.bias"))]
    if c.kv_size == c.q_size:  # o after v only without GQA (a v row feeds one o column)
        v0 = c.q_size + c.kv_size
        plan.append(("self_attn.o_proj", _rows(linears["self_attn.qkv_proj"], v0, v0 + c.kv_size,
                                               "self_attn.v_proj.bias")))
    return plan


def _rows(linear: Any, a: int, b: int, bias_name: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Output rows [a, b) of a linear: its weight's, its bias's (None without one) and the
    checkpoint name of the projection's bias (within the layer)."""
    bias = getattr(linear, "bias", None)
    return linear.weight.data[a:b], None if bias is None else bias.data[a:b], bias_name


def _fold(lay: _Layer, key: str, s: torch.Tensor, prev: torch.Tensor, prev_bias: torch.Tensor | None = None,
          bias_name: str = "") -> torch.Tensor:
    """Input columns of ``key`` times s; ``prev`` (a norm weight, or rows of the linear before,
    with their bias, kept for the checkpoint under ``bias_name``) over s."""
    prev.div_(s if prev.dim() == 1 else s[:, None])
    if prev_bias is not None:
        prev_bias.div_(s)
        lay.keep(bias_name, prev_bias)
    lay.linears[key].weight.data.mul_(s)
    return s


def _experts(lay: _Layer, moe: SparseMoe, x_mean: torch.Tensor, hidden: list[torch.Tensor], backend: Any) -> None:
    """AWQ of a sparse layer's experts (the module docstring): the shared gate/up scale, then
    each expert's down scale, clipping and rounding."""
    sc = lay.scheme
    experts = [f"mlp.experts.{e}" for e in range(len(moe.experts))]
    if moe.shared_expert is not None:
        experts.append("mlp.shared_expert")
    gate_ups = [f"{e}.gate_up_proj" for e in experts]
    stacked = torch.cat([lay.linears[k].weight.data for k in gate_ups])
    candidates = scale_candidates(x_mean, group_mean_abs_w(stacked, sc.group_size))
    del stacked
    errors = torch.zeros(len(candidates) + 1, dtype=torch.float64)  # [0]: no scaling
    sizes = {k: 8 * lay.linears[k].in_features ** 2 for k in gate_ups}
    for group in passes(sizes):
        rec = lay.record({k: lay.linears[k] for k in group}, hidden, backend)
        for key in group:
            h = rec[key].hessian() * rec[key].count  # summed over the expert's rows: experts weigh by their rows
            w = lay.linears[key].weight.data
            errors[0] += scaled_error(w, None, h, sc.bits, sc.group_size, sc.sym)
            for i, (_, s) in enumerate(candidates):
                errors[i + 1] += scaled_error(w, s, h, sc.bits, sc.group_size, sc.sym)
    best = int(errors.argmin())
    if best:
        s = candidates[best - 1][1]
        lay.layer.post_attention_layernorm.weight.data.div_(s)
        moe.gate.data.mul_(s)
        lay.keep("mlp.gate.weight", moe.gate.data)
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.data.mul_(s)
            lay.keep("mlp.shared_expert_gate.weight", moe.shared_expert_gate.data)
        for key in gate_ups:
            lay.linears[key].weight.data.mul_(s)
    sizes = {e: 8 * (lay.linears[f"{e}.gate_up_proj"].in_features ** 2 + lay.linears[f"{e}.down_proj"].in_features ** 2)
             for e in experts}
    for group in passes(sizes):
        rec = lay.record({f"{e}.{p}": lay.linears[f"{e}.{p}"] for e in group for p in ("gate_up_proj", "down_proj")},
                         hidden, backend)
        for e in group:
            _expert(lay, e, rec[f"{e}.gate_up_proj"], rec[f"{e}.down_proj"])


def _expert(lay: _Layer, e: str, gate_up: InputRecorder, down: InputRecorder) -> None:
    """One expert's down scale (folded into its up rows), then clipping and rounding; RTN
    when it saw fewer than ``MIN_ROWS`` rows."""
    sc = lay.scheme
    gu, dn = f"{e}.gate_up_proj", f"{e}.down_proj"
    if gate_up.count < MIN_ROWS:
        lay.quantize(gu, None, False)
        lay.quantize(dn, None, False)
        lay.fell_back += [lay.pre + n for key in (gu, dn) for n, _, _ in lay.parts[key]]
        return
    inter = lay.linears[dn].in_features
    h_down = down.hessian()
    if lay.layer.get_submodule(e).swiglu is None:  # gpt-oss's clamped (up + 1) does not commute with 1/s
        s = search_scale(h_down, down.mean_abs(), lay.linears[dn].weight.data, sc.bits, sc.group_size, sc.sym)[0]
        _fold(lay, dn, s, *_rows(lay.linears[gu], inter, 2 * inter, f"{e}.up_proj.bias"))
        h_down = h_down / (s[:, None] * s[None, :])
    lay.quantize(gu, gate_up.hessian(), lay.clip)
    lay.quantize(dn, h_down, lay.clip)
