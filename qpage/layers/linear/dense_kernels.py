"""Kernels for weights multiplied as dense float matrices: unquantized weights, and quantized
ones dequantized once (what no packed kernel runs, or ``dequantize_weights``).

fp32 on CPU runs on the C panels (``kernels.cpu.matmul.dense``), whose results do not depend
on the batch; without the C kernels, or for a weight rewritten in place after ``prepare``
(``LinearSpec.in_place``), on NumPy's BLAS, which reads the weight where it lies; anything
else on torch (``F.linear``). ``dense_matmul`` and ``dense_table`` make that choice for the
dequantized kernels by the same tests the dense kernels' ``can_implement`` make.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qpage.kernels.cpu.matmul import blas, dense
from qpage.layers.linear.kernel_spec import Built, LinearSpec


def dense_matmul(w_in_out: torch.Tensor, dtype: torch.dtype) -> Built:
    """A matmul on a dense weight [in, out] (any strides): the C panels for fp32 on CPU, else
    NumPy's BLAS (the weight kept ``[in, out]`` contiguous, its fastest layout), else
    ``F.linear``."""
    if dense.unsupported_reason(dtype, w_in_out.device) is None:
        panels = dense.DensePanels(w_in_out.t())
        return Built(panels, panels.nbytes, own_threads=True)
    if blas.supports(dtype, w_in_out.device):
        w_t: np.ndarray = w_in_out.to(dtype).contiguous().numpy()
        return Built(lambda x: blas.matmul_wt(x, w_t), w_t.nbytes)
    w = w_in_out.t().to(dtype).contiguous()
    return Built(lambda x: F.linear(x, w), w.numel() * w.element_size())


def dense_table(table: torch.Tensor, spec: LinearSpec, keeps_packed: bool = False) -> Built:
    """A dense table [vocab, hidden] (``LinearSpec.table``): rows read in place; its matmul (a
    tied head, when asked) on a packed copy where ``dense_matmul`` packs (the panels or the
    BLAS layout: the table's size again, but faster than reading the table in place),
    elsewhere ``F.linear`` on it."""
    table = table.to(spec.dtype).contiguous()
    nbytes = table.numel() * table.element_size()
    rows = lambda ids: F.embedding(ids, table)  # noqa: E731
    if spec.multiplies and blas.supports(spec.dtype, table.device):  # where dense_matmul packs a copy
        head = dense_matmul(table.t(), spec.dtype)
        return Built(head.mm, nbytes + head.weight_bytes, keeps_packed=keeps_packed, rows=rows,
                     own_threads=head.own_threads)
    return Built(lambda x: F.linear(x, table), nbytes, keeps_packed=keeps_packed, rows=rows)


class Dequantized:
    """The weight dequantized once at ``prepare`` and multiplied like a dense layer: on CPU
    for what no packed kernel runs, or on request (``dequantize_weights``), in fp32
    (``dense_matmul``); elsewhere a slow fallback with dense memory, which the server's doctor
    reports."""

    schemes, looks_up = ("int", "fp8", "blocks"), True

    def __init__(self, name: str, devices: tuple[str, ...] | None) -> None:
        self.name, self.devices = name, devices

    def can_implement(self, spec: LinearSpec) -> str | None:
        if self.devices is not None and spec.device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {spec.device.type}"
        return None

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        if spec.table:
            return dense_table(layer.dequantized_in_out().t(), spec)
        return dense_matmul(layer.dequantized_in_out(), spec.dtype)


class DenseNative:
    """An unquantized fp32 weight on CPU, packed into the C kernels' panels; the layer's own
    copy is released (the panels are the weight)."""

    name, schemes, looks_up = "cpu-dense", ("dense",), True

    def can_implement(self, spec: LinearSpec) -> str | None:
        if spec.in_place:
            return "packs a copy of the weight, which would miss its rewrites in place"
        return dense.unsupported_reason(spec.dtype, spec.device)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        if spec.table:
            return dense_table(layer.weight.data, spec, keeps_packed=True)
        panels = dense.DensePanels(layer.weight.data)
        return Built(panels, panels.nbytes, drops_weight=True, own_threads=True)


class DenseBlas:
    """An unquantized fp32 weight on CPU, on NumPy's BLAS: without the C kernels, or for a
    weight rewritten in place (the BLAS copy is the weight's own storage)."""

    name, schemes, looks_up = "cpu-blas", ("dense",), True

    def can_implement(self, spec: LinearSpec) -> str | None:
        return None if blas.supports(spec.dtype, spec.device) else "needs fp32 activations on cpu"

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        if spec.table:
            return dense_table(layer.weight.data, spec, keeps_packed=True)
        # Store W transposed ([in, out] contiguous); ``weight`` stays an [out, in] view of it, so
        # weights copied into it later (the quantizer's layer refills) reach the BLAS copy too.
        w_t = layer.weight.data.t().contiguous()
        layer.weight.data = w_t.t()
        w_np: np.ndarray = w_t.numpy()
        return Built(lambda x: blas.matmul_wt(x, w_np), w_np.nbytes, keeps_packed=True)


class DenseTorch:
    """An unquantized weight anywhere else: ``F.linear`` with the bias fused (one rounding in
    half precision)."""

    name, schemes, looks_up = "torch", ("dense",), True

    def can_implement(self, spec: LinearSpec) -> str | None:
        return None

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        if spec.table:
            return dense_table(layer.weight.data, spec, keeps_packed=True)
        w = layer.weight.data
        return Built(lambda x: F.linear(x, layer.weight, layer.bias), w.numel() * w.element_size(),
                     keeps_packed=True, adds_bias=True)
