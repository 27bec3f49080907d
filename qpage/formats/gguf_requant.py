"""Tensors requantized to a block format as they are read (``requantized``): what makes a
model's own weights a 4-bit draft model (``self:q4_0``) without a file written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from qpage.formats.gguf_model import GgufTensor

REQUANT_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
                 "q8_0": GGMLQuantizationType.Q8_0}
"""Block formats ``requantized`` writes (32-weight blocks: any width a multiple of 32 takes them)."""
HEAD_FORMAT = "q8_0"
"""Block format of the embedding and output head in a requantized model, whatever the format
of its layers: they map every vocabulary entry, and rounding them to 4 bits costs a small
draft model most of its agreement with its target (llama.cpp's quantizers, likewise, keep the
output tensor at 6 bits or more)."""


def requantized(tensors: Iterator[tuple[str, str, Any]], prefixes: set[str], fmt: str,
                heads: set[str] | None = None) -> Iterator[tuple[str, str, Any]]:
    """``tensors`` with the ``.weight`` of every prefix in ``prefixes`` (a model's quantized
    layers) requantized to block format ``fmt`` of ``REQUANT_TYPES`` through the ``gguf``
    package's reference quantizer, as ``GgufTensor``; those of ``heads`` (the embedding and
    output head) to ``HEAD_FORMAT`` instead. Other tensors pass unchanged. The weights must be
    float or already in blocks (decoded first)."""
    heads = heads or set()
    for file, name, value in tensors:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in prefixes:
            yield file, name, value
            continue
        qtype = REQUANT_TYPES[HEAD_FORMAT if prefix in heads else fmt]
        size = GGML_QUANT_SIZES[qtype][0]
        if suffix != "weight" or not isinstance(value, GgufTensor | torch.Tensor):
            raise ValueError(f"{file}: {name} is part of an already quantized layer; a {fmt} copy is made from "
                             "float or GGUF weights only (give a draft model file instead)")
        if isinstance(value, GgufTensor) and value.ggml_type == int(qtype):  # already in these blocks
            yield file, name, value
            continue
        w = value.dequantize() if isinstance(value, GgufTensor) else value.float()
        if w.dim() != 2 or w.shape[1] % size:
            raise ValueError(f"{file}: {name} has shape {tuple(w.shape)}; {qtype.name.lower()} needs rows of a "
                             f"multiple of {size} weights")
        rows = quantize(np.ascontiguousarray(w.numpy(), dtype=np.float32), qtype)
        yield file, name, GgufTensor(rows, int(qtype), (w.shape[0], w.shape[1]), name)
