"""Whether a Llama-family model's decode steps can run as one C call (``kernels.cpu.native_decode``),
and the glue that calls it: the decoder layers' weights gathered once, the step's caches
and block tables passed each time.

It fits a model whose every projection runs on the block-format kernels (``PiecewiseMatmul``)
with the C ops (fp32 on CPU), without q/k norms and with a bias on qkv at most, and an engine
whose attention is the C backend over plain fp32 caches: both decided once, at start
(``build_decode_stack``, ``unfit_reason_for``). Then every step whose rows are all decodes
runs fused. Anything else runs the Python path, which stays the reference.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qpage.kernels.cpu.matmul.native_gguf import PiecewiseMatmul
from qpage.kernels.cpu.native_decode import DecodeStack, LayerWeights, unfit_reason
from qpage.layers.attention.backends import CpuNativePagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, LayerKV
from qpage.layers.attention.metadata import AttentionMetadata
from qpage.layers.ops import CpuNativeOps

logger = logging.getLogger("qpage")


def _matmul(linear: Any, what: str) -> PiecewiseMatmul:
    mm = getattr(linear, "kernel_mm", None)
    if not isinstance(mm, PiecewiseMatmul):
        raise ValueError(f"{what} runs on {getattr(linear, 'kernel_path', 'a dense linear')}, not the block kernels")
    why = unfit_reason(mm)
    if why is not None:
        raise ValueError(f"{what}: {why}")
    return mm


def build_decode_stack(model: Any) -> DecodeStack | None:
    """The fused decode step for ``model`` (a prepared ``LlamaForCausalLM``), or None with the
    reason logged."""
    c = model.config
    try:
        if not isinstance(model.ops, CpuNativeOps):
            raise ValueError(f"the model's ops are {model.ops.name}, not the C kernels")
        if model.unfused_reason is not None:
            raise ValueError(model.unfused_reason)
        if model.attention_features():
            raise ValueError(f"its attention needs {', '.join(sorted(model.attention_features()))}")
        if c.qk_norm or c.o_bias or c.mlp_bias:
            raise ValueError("q/k norms or biases beyond qkv")
        layers = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                _matmul(attn.qkv_proj, f"layer {i} qkv"), attn.qkv_proj.bias,
                _matmul(attn.o_proj, f"layer {i} o_proj"), _matmul(mlp.gate_up_proj, f"layer {i} gate_up"),
                _matmul(mlp.down_proj, f"layer {i} down_proj")))
    except ValueError as e:
        logger.debug("decode steps run layer by layer in Python: %s", e)
        return None
    if any(t.dtype != torch.float32 or not t.is_contiguous() for w in layers for t in (w.in_norm, w.post_norm)):
        logger.debug("decode steps run layer by layer in Python: norms are not contiguous fp32")
        return None
    return DecodeStack(layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim**-0.5)


def unfit_reason_for(backend: object, spec: KVCacheSpec) -> str | None:
    """Why an engine's attention backend and KV cache cannot run the fused step (None: they
    can): it reads and writes plain fp32 cache blocks with the C attention."""
    if not isinstance(backend, CpuNativePagedAttention):
        return f"attention runs on {getattr(backend, 'name', type(backend).__name__)}, not the C kernels"
    if spec.format is not None or spec.dtype != torch.float32:
        return f"the KV cache is {spec.describe()}, not plain fp32"
    return None


def decode_only(meta: Any) -> bool:
    """Whether a step's rows are all decodes (the fused step's case)."""
    return isinstance(meta, AttentionMetadata) and not meta.prefills and bool(meta.decode_groups)


def run_decode_stack(stack: DecodeStack, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     caches: list[LayerKV], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, residual) after the last layer, as the Python layers would leave them."""
    stack.bind([(c.k, c.v) for c in caches])
    groups = []
    for d in meta.decode_groups:
        lens = d.seq_lens if d.seq_lens is not None else d.mask.view(d.mask.shape[0], -1).sum(-1)
        groups.append((d.start, d.end, d.block_table, lens))
    return stack(h, cos, sin, meta.slot_mapping, groups)
