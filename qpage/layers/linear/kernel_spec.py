"""What a linear kernel is given and what it gives back: ``LinearSpec`` (the weight's scheme
and shape and the activations), ``Built`` (the matmul and what it holds), and the
``LinearKernel`` protocol every kernel of ``linear_kernels`` and ``dense_kernels`` follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearSpec:
    """What a kernel must handle: the weight's scheme and shape, and the activations."""

    scheme: str
    """``dense``, ``int`` (GPTQ/AWQ/compressed-tensors INT4/INT8), ``fp8``, or ``blocks`` (a
    block format of the CPU kernels: a GGUF file's tensors, bitsandbytes 4-bit written as
    NF4/FP4 blocks at load)."""
    device: torch.device
    dtype: torch.dtype
    """The activations' dtype."""
    in_features: int
    out_features: int
    bits: int = 0
    group_size: int = 0
    g_idx: torch.Tensor | None = None
    """Act-order row -> group map (INT), None without act-order."""
    fp8_block_aligned: bool = True
    """FP8 block scales: every fused projection starts on a scale block boundary."""
    ggml_types: tuple[int, ...] = ()
    """``blocks``: the format (ggml type id) of each part of the (possibly fused) weight."""
    symmetric: bool = True
    """INT: every zero point is 2^(bits - 1) (the codes are signed around it)."""
    dequantize: bool = False
    """The weight is to be dequantized once (``dequantize_weights``): no packed kernel runs it."""
    table: bool = False
    """The weight is also a table whose rows are looked up: a token embedding [vocab, hidden]
    (``out_features`` = vocab), whose matmul is the tied LM head."""
    multiplies: bool = True
    """A table: whether its matmul runs too (a tied head), else only its rows are read."""
    in_place: bool = False
    """The weight is rewritten where it lies after ``prepare`` (the quantizer's calibration
    shell refills and updates it) and the matmul must see that: no kernel may copy it."""


@dataclass
class Built:
    mm: Matmul
    weight_bytes: int
    """Bytes the weight occupies on this path."""
    keeps_packed: bool = False
    """Whether ``mm`` reads the layer's packed tensors (else the layer drops them)."""
    adds_bias: bool = False
    """Whether ``mm`` adds the layer's bias itself (fused into the matmul)."""
    kernel_mm: Matmul | None = None
    """The kernel's own matmul, before ``build_linear`` adds the layer's bias to ``mm`` (the same
    as ``mm`` when the kernel adds the bias itself)."""
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A table (``LinearSpec.table``): token ids [T] -> their rows [T, hidden] in the spec's dtype."""
    drops_weight: bool = False
    """Whether the layer's dense ``weight`` may be released (``mm`` holds its own copy)."""
    own_threads: bool = False
    """Whether ``mm`` splits its rows across the cores itself (OpenMP in the C kernels), so
    NumPy's BLAS should keep one thread beside it (``runner.model_runner.set_threads``)."""


class LinearKernel(Protocol):
    name: str
    schemes: tuple[str, ...]
    looks_up: bool
    """Whether it also reads rows of its weight (runs a ``LinearSpec.table``)."""

    def can_implement(self, spec: LinearSpec) -> str | None: ...

    def build(self, layer: Any, spec: LinearSpec) -> Built: ...


DEQUANTIZE_ASKED = "dequantize_weights=True asks for the dequantized path"
