"""The one choice of kernel for each linear layer, made once at ``prepare``.

Each kernel declares whether it can run a layer (``can_implement(spec) -> None | reason``) and,
when chosen, builds the layer's matmul from its loaded weights. ``select_linear_kernel`` tries
the kernels of the layer's scheme in priority order, logs the ones passed over, and when none
fits raises with every reason. ``build_linear`` is what a layer's ``prepare`` calls: the chosen
kernel's matmul with the layer's bias added (or fused by the kernel), so a layer's forward is
that one call. A kernel's ``name`` is the layer's ``kernel_path``, which the start line and
``qpage:quantized_linear_layers{path=...}`` report.

Priority: the fused Triton kernels on CUDA (GGUF blocks: ``triton-blocks``); on CPU the block
kernels (``cpu-blocks``) for GGUF and bitsandbytes 4-bit weights and for
GPTQ/AWQ/compressed-tensors INT4/INT8 written as blocks, in every dtype; torch's packed
INT4/INT8 kernels (fast only with bf16 activations) for integer weights that have no block
form; else the weight dequantized once and multiplied as a dense one (``dense_kernels``:
fp32 on the C panels, else NumPy's BLAS or torch); anywhere else the dequantized torch
fallback, which the doctor reports. ``dequantize_weights=True`` (``LinearSpec.dequantize``)
skips every packed kernel. Unquantized weights: the C panels (``cpu-dense``) for fp32 on CPU,
NumPy's BLAS without the C kernels or for a weight rewritten in place, else torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qpage.formats.gguf_model import GgufTensor
from qpage.formats.gguf_reader import BF16, FLOAT_TYPES, type_name
from qpage.kernels import block_matmul
from qpage.kernels.cpu import native
from qpage.kernels.cpu.matmul import int_blocks, native_gguf, packed
from qpage.kernels.cpu.matmul.dense import DensePanels
from qpage.kernels.fp8.matmul import fp8_matmul
from qpage.kernels.int_matmul import int_matmul
from qpage.kernels.packing import unpack_cols, unpack_rows
from qpage.kernels.triton_utils import triton_unavailable_reason
from qpage.layers.linear.dense_kernels import DenseBlas, DenseNative, DenseTorch, Dequantized
from qpage.layers.linear.kernel_spec import DEQUANTIZE_ASKED, Built, LinearKernel, LinearSpec, Matmul

logger = logging.getLogger("qpage")

def _needs_triton(spec: LinearSpec) -> str | None:
    if spec.dequantize:
        return DEQUANTIZE_ASKED
    return triton_unavailable_reason("cuda") if spec.device.type == "cuda" else f"runs on cuda, not {spec.device.type}"


class TritonInt:
    name, schemes, looks_up = "triton-fused", ("int",), False

    def can_implement(self, spec: LinearSpec) -> str | None:
        return _needs_triton(spec)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        group = layer.cfg.group_size or layer.in_features

        def mm(x: torch.Tensor) -> torch.Tensor:
            return int_matmul(x, layer.qweight, layer.scales, layer.qzeros, layer.g_idx, bits=layer.cfg.bits,
                              group_size=group)

        nbytes = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.qzeros, layer.scales))
        return Built(mm, nbytes, keeps_packed=True)


class TritonFp8:
    name, schemes, looks_up = "triton-fused", ("fp8",), False

    def can_implement(self, spec: LinearSpec) -> str | None:
        if not spec.fp8_block_aligned:
            return "a fused projection does not start on a 128-row scale block"
        return _needs_triton(spec)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        b = layer.cfg.block
        scale = layer.scale if b is None else layer.scale[::b].contiguous()  # the [ceil(out/b), ceil(in/b)] grid
        codes = layer.codes
        return Built(lambda x: fp8_matmul(x, codes, scale), codes.numel() + 4 * scale.numel(), keeps_packed=True)


class CpuPackedInt:
    """torch's packed CPU matmuls (``kernels.cpu.matmul.packed``): the weight stays at 4 or 8 bits."""

    schemes, looks_up = ("int",), False

    def __init__(self, bits: int) -> None:
        self.bits, self.name = bits, f"cpu-int{bits}pack"

    def can_implement(self, spec: LinearSpec) -> str | None:
        if spec.dequantize:
            return DEQUANTIZE_ASKED
        if spec.device.type != "cpu":
            return f"runs on cpu, not {spec.device.type}"
        if spec.bits != self.bits:
            return f"{spec.bits}-bit weights"
        return packed.packed_reason(spec.bits, spec.group_size, spec.g_idx, spec.in_features, spec.out_features,
                                    spec.dtype)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        q = unpack_rows(layer.qweight, self.bits, layer.in_features)
        zeros = unpack_cols(layer.qzeros, self.bits, layer.out_features)
        if self.bits == 4:
            p4 = packed.pack_int4(q, layer.scales, zeros, layer.g_idx, spec.group_size, spec.dtype)
            return Built(lambda x: packed.int4_mm(x, p4), p4.nbytes())
        p8 = packed.pack_int8(q, layer.scales, zeros, spec.dtype)
        return Built(lambda x: packed.int8_mm(x, p8), p8.nbytes())


def _blocks_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"runs on cpu, not {device.type}"
    if native.load() is None:
        return f"the C kernels are unavailable ({native.unavailable_reason()})"
    return None


def blocks_reason(device: torch.device, ggml_types: tuple[int, ...], k: int) -> str | None:
    """Why ``cpu-blocks`` cannot run a weight with parts in ``ggml_types`` (None: it can)."""
    why = _blocks_reason(device)
    if why is not None:
        return why
    for t in ggml_types:
        if t in FLOAT_TYPES or t == BF16:
            continue
        why = native_gguf.unsupported_reason(t, k)
        if why is not None:
            return f"{native_gguf.NAMES.get(t) or type_name(t)}: {why}"
    return None


class CpuBlockWeights:
    """Block-format weights kept packed on CPU (``kernels.cpu.matmul.native_gguf``): each run of
    consecutive parts in one format is repacked into one weight; float parts go on the dense
    panels. A table (an embedding) in one block format dequantizes its rows from the same
    packed weight its tied head multiplies with, so the table is held once."""

    name, schemes, looks_up = "cpu-blocks", ("blocks",), True

    def can_implement(self, spec: LinearSpec) -> str | None:
        if spec.dequantize:
            return DEQUANTIZE_ASKED
        if spec.table and (len(spec.ggml_types) != 1 or spec.ggml_types[0] in (*FLOAT_TYPES, BF16)):
            return "reads rows of a table in one block format only (a float table is read densely)"
        return blocks_reason(spec.device, spec.ggml_types, spec.in_features)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        k = spec.in_features
        runs: list[tuple[int, int, list[Any]]] = []  # (first column, ggml type, parts)
        for offset, value in layer.parts:
            t = value.ggml_type if isinstance(value, GgufTensor) else -1
            if runs and runs[-1][1] == t and t != -1:
                runs[-1][2].append(value)
            else:
                runs.append((offset, t, [value]))
        pieces: list[native_gguf.Piece] = []
        for offset, t, values in runs:
            w = DensePanels(values[0].float()) if t == -1 else native_gguf.repack([v.rows for v in values], t, k)
            pieces.append((offset, offset + sum(v.shape[0] for v in values), w))
        mm = native_gguf.PiecewiseMatmul(pieces, k, spec.out_features)
        rows = None
        if spec.table:
            table = pieces[0][2]
            assert isinstance(table, native_gguf.PackedWeight)
            rows = lambda ids: native_gguf.dequantize_rows(table, ids).to(spec.dtype)  # noqa: E731
        return Built(mm, mm.weight_bytes(), rows=rows, own_threads=True)


class TritonBlocks:
    """Block-format weights on CUDA (``kernels.block_matmul``): Q4_0/Q8_0 as GPTQ integers on
    the INT kernels, Q4_1/Q4_K/Q6_K decoded from the file's bytes into cuBLAS matmuls, float
    parts dense; the parts' outputs side by side."""

    name, schemes, looks_up = "triton-blocks", ("blocks",), False

    def can_implement(self, spec: LinearSpec) -> str | None:
        why = _needs_triton(spec)
        if why is not None:
            return why
        for t in spec.ggml_types:
            if t in native_gguf.NAMES:
                return f"bitsandbytes {native_gguf.NAMES[t]} runs packed on CPU only; on CUDA it is dequantized once"
            if t not in FLOAT_TYPES and t != BF16:
                why = block_matmul.unsupported_reason(t, spec.in_features)
                if why is not None:
                    return f"{type_name(t)}: {why}"
        return None

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        k, dev = spec.in_features, spec.device
        mms: list[Matmul] = []
        nbytes = 0
        for _, v in layer.parts:
            if not isinstance(v, GgufTensor):
                dense = v.to(dev, spec.dtype)
                mms.append(lambda x, w=dense: F.linear(x, w))
                nbytes += dense.numel() * dense.element_size()
            elif v.ggml_type in block_matmul.GPTQ_TYPES:
                g = block_matmul.to_gptq(v.rows, v.ggml_type, k, dev)
                mms.append(g)
                nbytes += g.qweight.numel() * 4 + g.scales.numel() * 2
            else:
                rows = torch.from_numpy(np.ascontiguousarray(v.rows)).to(dev)
                mms.append(block_matmul.DequantWeight(rows, v.ggml_type, k))
                nbytes += rows.numel()
        if len(mms) == 1:
            return Built(mms[0], nbytes)
        return Built(lambda x: torch.cat([mm(x) for mm in mms], dim=-1), nbytes)


class CpuIntBlocks:
    """GPTQ/AWQ/compressed-tensors INT4/INT8 written once as Q4_0/Q4_1/Q8_0/Q8_M blocks
    (``kernels.cpu.matmul.int_blocks``) and run on the block kernels, act-order included."""

    name, schemes, looks_up = "cpu-blocks", ("int",), False

    def can_implement(self, spec: LinearSpec) -> str | None:
        if spec.dequantize:
            return DEQUANTIZE_ASKED
        return _blocks_reason(spec.device) or int_blocks.int_blocks_reason(
            spec.bits, spec.group_size, spec.g_idx, spec.in_features)

    def build(self, layer: Any, spec: LinearSpec) -> Built:
        b = int_blocks.to_block_rows(unpack_rows(layer.qweight, spec.bits, spec.in_features), layer.scales,
                                     unpack_cols(layer.qzeros, spec.bits, spec.out_features), spec.g_idx,
                                     spec.bits, spec.group_size)
        w = native_gguf.repack(b.rows, b.ggml_type, spec.in_features)
        mm = native_gguf.PiecewiseMatmul([(0, spec.out_features, w)], spec.in_features, spec.out_features,
                                         input_perm=b.perm)
        return Built(mm, mm.weight_bytes(), own_threads=True)


LINEAR_KERNELS: tuple[LinearKernel, ...] = (
    TritonInt(), TritonFp8(), TritonBlocks(), CpuBlockWeights(), CpuIntBlocks(), CpuPackedInt(4), CpuPackedInt(8),
    Dequantized("cpu-dequantized", ("cpu",)), Dequantized("dequantized-fallback", None),
    DenseNative(), DenseBlas(), DenseTorch(),
)


def select_linear_kernel(spec: LinearSpec, kernels: Sequence[LinearKernel] = LINEAR_KERNELS) -> LinearKernel:
    """The first kernel of the spec's scheme that can run it (see the module docstring)."""
    reasons = []
    for k in kernels:
        if spec.scheme not in k.schemes:
            continue
        why = "does not read rows of a table (an embedding)" if spec.table and not k.looks_up else k.can_implement(spec)
        if why is None:
            for r in reasons:
                logger.debug("%s linear [%d -> %d]: skipped %s", spec.scheme, spec.in_features, spec.out_features, r)
            return k
        reasons.append(f"{k.name}: {why}")
    what = "table" if spec.table else "linear"
    raise ValueError(f"no kernel runs a {spec.scheme} {what} [{spec.in_features} -> {spec.out_features}] on "
                     f"{spec.device.type} with {spec.dtype}: " + "; ".join(reasons))


def build_linear(layer: Any, spec: LinearSpec) -> tuple[LinearKernel, Built]:
    """The chosen kernel for ``layer`` and its matmul, which computes the whole layer: the
    layer's ``bias`` (if any) is added here unless the kernel fused it."""
    kernel = select_linear_kernel(spec)
    built = kernel.build(layer, spec)
    built.kernel_mm = built.mm
    bias = layer.bias
    if bias is not None and not built.adds_bias:
        mm = built.mm
        built.mm = lambda x: mm(x) + bias
    return kernel, built
