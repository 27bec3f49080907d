"""Calibrated quantization (GPTQ, importance-weighted RTN, AWQ): decoder layer by decoder
layer, on real activations.

For each layer: run the calibration windows through it (inputs quantized by the layers
before, as GPTQ does), accumulate the Hessian 2/n X X^T of each linear's inputs (only its
diagonal for the importance-weighted RTN, ``imatrix``), quantize its weights
(``gptq.gptq_quantize`` or ``rtn.quantize_rtn``), put the dequantized weights back so the
next layer sees the quantized model's activations, and run the windows through once more.
q/k/v share one Hessian (one input), as do gate/up. AWQ runs the same layers with its own
searches (``awq_layers``).

Memory stays bounded (``layer_source``): one decoder layer is read from the shards at a
time, and each layer's results are spilled to the job's temporary folder, from where the
same streamed, atomic writer as RTN's (``pipeline``) reads them back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from qpage.formats.scheme import QuantScheme
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan
from qpage.quantizers.gptq import gptq_quantize
from qpage.quantizers.layer_source import LayerSource, Result, ResultStore
from qpage.quantizers.rtn import quantize_rtn


class _Hessian:
    """What a linear's calibration inputs give the quantizer: H = 2/n X^T X, or only its
    diagonal (``diagonal_only``: the importance-weighted RTN needs no more)."""

    def __init__(self, n: int, diagonal_only: bool = False) -> None:
        self.diagonal_only = diagonal_only
        self.h = torch.zeros(n if diagonal_only else (n, n), dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.count += x.shape[0]
        if self.diagonal_only:
            self.h += x.square().sum(0).double()
            return
        # One window's X^T X in fp32 (NumPy's BLAS, multi-threaded; torch is on one thread
        # here), summed across windows in fp64: twice as fast as fp64 products, and a window
        # sums only a few hundred terms per entry.
        xn = x.numpy()
        self.h += torch.from_numpy(xn.T @ xn).double()

    def value(self) -> torch.Tensor:
        return (2 * self.h / max(self.count, 1)).float()


HESSIAN_BUDGET = 2 << 30
"""Bytes of Hessians one pass over the calibration windows records: a layer whose linears
need more (a mixture of experts: Mixtral-8x7B's eight down projections alone are 13 GB in
fp64) is recorded in several passes, each quantizing its linears and freeing their Hessians."""
MIN_ROWS = 32
"""Calibration rows below which a linear is rounded (RTN) rather than calibrated: an expert of a
mixture that few tokens were routed to (its Hessian would be mostly the damping term)."""
Parts = list[tuple[str, int, int]]
"""The projections of one fused linear: (checkpoint prefix, first row, rows)."""
Quantize = Callable[[torch.Tensor, _Hessian, Parts], tuple[dict[str, Any], torch.Tensor]]
"""A fused linear's weight [out, in], its inputs' statistics and its projections -> (each
projection's result by prefix, the dequantized weight the next layers run on)."""


class ResultSink(Protocol):
    def put_layer(self, layer: int, results: dict[str, Any]) -> None: ...


def gptq_calibrate(src: Path, scheme: QuantScheme, windows: list[list[int]], store: ResultStore,
                   on_layer: Callable[[int, int], None] | None = None) -> ResultStore:
    """GPTQ every decoder linear of ``src`` into ``store`` (prefix -> (q, scales, zeros, g_idx))."""
    def quantize(w: torch.Tensor, stats: _Hessian, parts: Parts) -> tuple[dict[str, Any], torch.Tensor]:
        return _split(gptq_quantize(w, stats.value(), scheme.bits, scheme.group_size, scheme.sym,
                                    act_order=scheme.act_order, static_groups=scheme.static_groups),
                      parts, scheme.group_size)

    store.rtn_fallbacks = calibrate_layers(src, windows, store, on_layer, quantize, diagonal_only=False,
                                           fallback=_rtn(scheme))
    return store


def imatrix_calibrate(src: Path, scheme: QuantScheme, windows: list[list[int]], store: ResultStore,
                      on_layer: Callable[[int, int], None] | None = None) -> ResultStore:
    """Importance-weighted RTN of every decoder linear (``rtn.quantize_rtn`` with E[x^2] of its
    inputs, llama.cpp's importance matrix) into ``store``."""
    def quantize(w: torch.Tensor, stats: _Hessian, parts: Parts) -> tuple[dict[str, Any], torch.Tensor]:
        q, s, z = quantize_rtn(w, scheme.bits, scheme.group_size, scheme.sym, importance=stats.value())
        return _split((q, s, z, None), parts, scheme.group_size)

    store.rtn_fallbacks = calibrate_layers(src, windows, store, on_layer, quantize, diagonal_only=True,
                                           fallback=_rtn(scheme))
    return store


def _rtn(scheme: QuantScheme) -> Quantize:
    """Plain rounding, for linears that saw fewer than ``MIN_ROWS`` calibration rows."""
    def quantize(w: torch.Tensor, stats: _Hessian, parts: Parts) -> tuple[dict[str, Any], torch.Tensor]:
        return _split((*quantize_rtn(w, scheme.bits, scheme.group_size, scheme.sym), None), parts, scheme.group_size)

    return quantize


def _split(r: Result, parts: Parts, group_size: int | None) -> tuple[dict[str, Any], torch.Tensor]:
    """A fused linear's integers split by projection (rows are output columns of q), and its
    dequantized weight."""
    q, s, z, g_idx = r
    out = {prefix: (q[:, off : off + rows].contiguous(), s[:, off : off + rows].contiguous(),
                    z[:, off : off + rows].contiguous(), g_idx) for prefix, off, rows in parts}
    grp = g_idx.long() if g_idx is not None else torch.arange(q.shape[0]) // (group_size or q.shape[0])
    return out, ((q.to(torch.int32) - z[grp]).float() * s[grp]).t()


@torch.inference_mode()
def calibrate_layers(src: Path, windows: list[list[int]], store: ResultSink,
                     on_layer: Callable[[int, int], None] | None, quantize: Quantize, diagonal_only: bool,
                     fallback: Quantize | None = None) -> list[str]:
    """Run ``windows`` through ``src`` decoder layer by decoder layer, quantizing each layer's
    linears with ``quantize`` on their inputs' statistics (the full Hessian, or its diagonal)
    before the windows go on to the next layer; each layer's results go to ``store``. A linear
    that saw fewer than ``MIN_ROWS`` rows (an expert few tokens were routed to) is quantized
    with ``fallback`` where given; their projections' prefixes are returned."""
    threads = torch.get_num_threads()
    # NOTE: the fp32 CPU matmuls run on NumPy's BLAS threads; torch's own OpenMP threads
    # would spin against them (see qpage.layers.ops), so torch runs on one thread here.
    torch.set_num_threads(1)
    try:
        return _layer_by_layer(src, windows, store, on_layer, quantize, diagonal_only, fallback)
    finally:
        torch.set_num_threads(threads)


def fused_parts(projs: list[tuple[str, str, int, int]]) -> dict[str, Parts]:
    """Fused module -> its checkpoint projections (name, first row, rows), from ``layer_projections``."""
    parts: dict[str, Parts] = {}
    for name, fused, off, rows in projs:
        parts.setdefault(fused, []).append((name, off, rows))
    return parts


def _layer_by_layer(src: Path, windows: list[list[int]], store: ResultSink,
                    on_layer: Callable[[int, int], None] | None, quantize: Quantize, diagonal_only: bool,
                    fallback: Quantize | None) -> list[str]:
    source = LayerSource(src, max(len(w) for w in windows) + 1)
    c = source.arch
    backend = TorchPagedAttention(KVCacheSpec(torch.float32))
    hidden = source.embed(windows)
    fell_back: list[str] = []
    for li in range(c.num_layers):
        layer = source.layer(li)
        parts = fused_parts(source.shell(li).layer_projections(0))
        out: dict[str, Any] = {}
        linears = {fused: layer.get_submodule(fused) for fused in parts}
        pre = f"model.layers.{li}."
        new_weights = {}
        sizes = {k: 8 * m.in_features * (1 if diagonal_only else m.in_features) for k, m in linears.items()}
        for group in passes(sizes):
            # Every pass sees the layer as it was: the quantized weights go in after the last.
            hess = {k: _Hessian(linears[k].in_features, diagonal_only) for k in group}
            run_layer(source.shell(li), layer, hidden, backend, c, record=({k: linears[k] for k in group}, hess))
            for key in group:
                # Rows are independent (GPTQ's share H): the fused weight is quantized in one
                # pass and split into its projections by the quantizer.
                few = fallback is not None and hess[key].count < MIN_ROWS
                results, new_weights[key] = (fallback if few else quantize)(  # type: ignore[operator]
                    linears[key].weight.data, hess.pop(key), [(pre + n, off, rows) for n, off, rows in parts[key]])
                if few:
                    fell_back += [pre + n for n, _, _ in parts[key]]
                out.update(results)
        for key, w in new_weights.items():
            linears[key].weight.data.copy_(w)  # also updates the BLAS copy
        store.put_layer(li, out)
        hidden = run_layer(source.shell(li), layer, hidden, backend, c, record=None)
        if on_layer is not None:
            on_layer(li + 1, c.num_layers)
    return fell_back


def passes(sizes: dict[str, int]) -> list[list[str]]:
    """Keys in order, grouped so that each group's statistics (``sizes``: bytes per key) fit
    ``HESSIAN_BUDGET`` (a key larger than that alone); one group for a dense layer."""
    groups: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if groups[-1] and used + size > HESSIAN_BUDGET:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += size
    return groups


def run_layer(model: Any, layer: Any, hidden: list[torch.Tensor], backend: Any, c: Any,
              record: tuple[dict[str, Any], dict[str, _Hessian]] | None) -> list[torch.Tensor]:
    """Each window through one decoder layer (a fresh prefill), recording linear inputs if asked;
    ``model``: the one-layer shell that holds ``layer`` (its rotary tables)."""
    saved = {}
    if record is not None:
        linears, hess = record
        for key, mod in linears.items():
            saved[key] = mod.forward

            def hook(x: torch.Tensor, _k: str = key, _f: Any = mod.forward) -> torch.Tensor:
                hess[_k].add(x)
                return _f(x)

            mod.forward = hook
    try:
        outs = []
        spec = KVCacheSpec(torch.float32)
        for h in hidden:
            t = h.shape[0]
            nb = -(-t // 16)
            cache = make_layer_kv(spec, nb, c.num_kv_heads, c.head_dim, torch.device("cpu"))
            pos = torch.arange(t)
            meta = backend.build_metadata(AttentionBatch(pos, prefills=[SeqSpan(0, t, t, list(range(nb)))]), pos.device)
            cos, sin = model.rotary_for(0).lookup(pos)
            outs.append(layer.forward(h, cos, sin, cache, meta, backend))
        return outs
    finally:
        if record is not None:
            for key, mod in record[0].items():
                mod.forward = saved[key]
