"""Whether a Llama-family model's decode steps can run as one C call (``kernels.cpu.native_decode``),
and the glue that calls it: the decoder layers' weights gathered once, the step's caches
and block tables passed each time.

It fits a model (Llama family, Gemma, mixtures of experts on the C block) whose every
projection runs on the block-format kernels (``PiecewiseMatmul``) with the C ops (fp32 on
CPU), biases on the attention's projections at most, and an engine whose attention is the C
backend over plain fp32 caches: both decided once, at start
(``build_decode_stack``, ``unfit_reason_for``). Then every step whose rows are all decodes
runs fused. Anything else runs the Python path, which stays the reference.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qpage.kernels.cpu.matmul.native_gguf import PiecewiseMatmul
from qpage.kernels.cpu.native_decode import DecodeStack, LayerWeights
from qpage.kernels.cpu.native_moe import MoeKernel, unfit_reason
from qpage.layers.attention.backends import CpuNativePagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, LayerKV
from qpage.layers.attention.metadata import AttentionMetadata
from qpage.layers.moe import SparseMoe
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


def _mlp(i: int, mlp: Any) -> tuple[PiecewiseMatmul | None, PiecewiseMatmul | None, MoeKernel | None]:
    """(gate_up, down) of a dense MLP, or the C block of a mixture of experts."""
    if isinstance(mlp, SparseMoe):
        if mlp.kernel is None:
            raise ValueError(f"layer {i}'s experts run on torch: {mlp.unfit}")
        return None, None, mlp.kernel
    return _matmul(mlp.gate_up_proj, f"layer {i} gate_up"), _matmul(mlp.down_proj, f"layer {i} down_proj"), None


def build_decode_stack(model: Any) -> DecodeStack | None:
    """The fused decode step for ``model`` (a prepared ``LlamaForCausalLM``), or None with the
    reason logged."""
    c = model.config
    try:
        if not isinstance(model.ops, CpuNativeOps):
            raise ValueError(f"the model's ops are {model.ops.name}, not the C kernels")
        if c.mlp_bias:
            raise ValueError("biases on the dense MLP")
        layers = [_layer_weights(i, layer) for i, layer in enumerate(model.layers)]
    except ValueError as e:
        logger.debug("decode steps run layer by layer in Python: %s", e)
        return None
    if any(t.dtype != torch.float32 or not t.is_contiguous() for w in layers for t in w.norms()):
        logger.debug("decode steps run layer by layer in Python: norms are not contiguous fp32")
        return None
    return DecodeStack(layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.attention_scale,
                       gelu=c.hidden_act != "silu", softcap=c.attn_logit_softcap)


def _layer_weights(i: int, layer: Any) -> LayerWeights:
    """Decoder layer ``i`` (a Llama or Gemma layer, ``fused_norms``) as the step reads it."""
    attn, mlp = layer.self_attn, layer.mlp
    before_attn, before_mlp, attn_out, mlp_out = layer.fused_norms()

    def weight(norm: Any) -> torch.Tensor | None:
        return None if norm is None else norm.effective_weight()

    gate_up, down, moe = _mlp(i, mlp)
    return LayerWeights(
        before_attn.effective_weight(), before_mlp.effective_weight(),
        _matmul(attn.qkv_proj, f"layer {i} qkv"), attn.qkv_proj.bias,
        _matmul(attn.o_proj, f"layer {i} o_proj"), gate_up, down, weight(attn.q_norm), weight(attn.k_norm),
        weight(attn_out), weight(mlp_out), layer.rope_index, attn.window, moe,
        None if attn.sinks is None else attn.sinks.data, attn.o_proj.bias)


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


def run_decode_stack(stack: DecodeStack, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                     caches: list[LayerKV], metas: list[AttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, residual) after the last layer, as the Python layers would leave them; ``metas``: each
    layer's metadata (one per KV group, shared by its layers)."""
    unique: dict[int, int] = {}
    for m in metas:
        unique.setdefault(id(m), len(unique))
    stack.bind([(c.k, c.v) for c in caches], [unique[id(m)] for m in metas])
    parts = []
    for meta in {id(m): m for m in metas}.values():
        groups = []
        for d in meta.decode_groups:
            lens = d.seq_lens if d.seq_lens is not None else d.mask.view(d.mask.shape[0], -1).sum(-1)
            groups.append((d.start, d.end, d.block_table, lens))
        parts.append((meta.slot_mapping, groups))
    return stack(h, ropes, parts)
