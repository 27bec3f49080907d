"""Mixture-of-experts models on the Llama family's layers: Qwen2-MoE, Qwen3-MoE, Mixtral and
gpt-oss.

Attention, norms and the dense layers are the Llama family's (``models.llama``; Qwen3-MoE
has Qwen3's q/k norms, Qwen2-MoE Qwen2's qkv bias, gpt-oss biases everywhere, sinks and
alternating windowed layers); a sparse layer's MLP is a ``layers.moe.SparseMoe``. Checkpoint
names are Qwen's (``mlp.gate``, ``mlp.experts.N.gate_proj``, ``mlp.shared_expert``,
``mlp.shared_expert_gate``); Mixtral's (``block_sparse_moe.gate``, ``experts.N.w1/w3/w2``)
and gpt-oss's (``mlp.router``, stacked ``mlp.experts.gate_up_proj``) are read as those.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from qpage.formats.gguf_model import GgufTensor
from qpage.formats.safetensors_io import LazyTensor
from qpage.layers.moe import SparseMoe
from qpage.models.arch import ArchConfig
from qpage.models.llama import DecoderLayer, LlamaForCausalLM, linear_quant, projections
from qpage.models.sharding import WHOLE_MODEL, PartLoader

_MIXTRAL = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])(?=\.|$))?")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
GPT_OSS_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
"""gpt-oss's stacked experts (layer prefix, projection, suffix: none for a float weight, or
``_bias``, or an MXFP4 checkpoint's ``_blocks`` / ``_scales``): split by ``gpt_oss_experts``."""
_SPLIT_SUFFIX = {None: "weight", "_bias": "bias", "_blocks": "weight", "_scales": "weight_scale"}
"""The name an expert's part takes (``formats.mxfp4`` reads ``weight`` codes with ``weight_scale``)."""


def mixtral_name(name: str) -> str:
    """A Mixtral tensor name as Qwen's MoE names it (other names unchanged)."""
    def sub(m: re.Match[str]) -> str:
        return f".mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}" if m.group(1) else ".mlp."

    return _MIXTRAL.sub(sub, name, count=1)


def expert_projections(prefix: str, inter: int, hidden: int) -> list[tuple[str, str, int, int]]:
    """An expert MLP's checkpoint projections under ``prefix`` (``llama.projections``' form)."""
    return [(f"{prefix}.gate_proj", f"{prefix}.gate_up_proj", 0, inter),
            (f"{prefix}.up_proj", f"{prefix}.gate_up_proj", inter, inter),
            (f"{prefix}.down_proj", f"{prefix}.down_proj", 0, hidden)]


class MoeForCausalLM(LlamaForCausalLM):
    def build_layer(self, c: ArchConfig, i: int, max_positions: int) -> nn.Module:
        if not c.is_sparse(i):
            return super().build_layer(c, i, max_positions)
        swiglu = None if c.swiglu_limit is None else (c.swiglu_limit, c.swiglu_alpha)
        moe = SparseMoe(c.hidden_size, c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.norm_topk_prob,
                        c.shared_expert_intermediate_size, linear_quant(c), c.expert_bias, swiglu)
        return DecoderLayer(c, c.attention_windows(max_positions)[i], moe)

    def layer_projections(self, i: int) -> list[tuple[str, str, int, int]]:
        c = self.config
        if not c.is_sparse(i):
            return projections(c)
        out = [p for p in projections(c) if p[0].startswith("self_attn.")]
        for e in range(c.num_experts):
            out += expert_projections(f"mlp.experts.{e}", c.moe_intermediate_size, c.hidden_size)
        if c.shared_expert_intermediate_size:
            out += expert_projections("mlp.shared_expert", c.shared_expert_intermediate_size, c.hidden_size)
        return out

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        out = super().weight_targets()
        for i, layer in enumerate(self.layers):
            moe = layer.mlp
            if isinstance(moe, SparseMoe):
                out[f"model.layers.{i}.mlp.gate.weight"] = (moe.gate, 0, moe.gate.shape[0])
                if moe.gate_bias is not None:
                    out[f"model.layers.{i}.mlp.gate.bias"] = (moe.gate_bias, 0, moe.gate_bias.shape[0])
                if moe.shared_expert_gate is not None:
                    out[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = (moe.shared_expert_gate, 0, 1)
        return out

    def load_weights(self, tensors: Iterable[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]],
                     parts: PartLoader = WHOLE_MODEL) -> None:
        super().load_weights(_renamed(tensors), parts)


def _renamed(tensors: Iterable[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]]
             ) -> Iterator[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]]:
    """Every tensor under Qwen's MoE names (``split_stacked``)."""
    for file, name, t in tensors:
        if GPT_OSS_EXPERTS.match(name) is None:
            yield file, qwen_name(name), t
            continue
        value = t.read() if isinstance(t, LazyTensor) else t
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{file}: {name} is a GGUF-typed stacked tensor; gpt-oss's stacked experts load from "
                             "safetensors (float or MXFP4 blocks)")
        for split_name, part in split_stacked(name, value):
            yield file, split_name, part


def qwen_name(name: str) -> str:
    """A tensor name as the MoE layers name it: Mixtral's renamed, gpt-oss's router as ``mlp.gate``
    (other names unchanged)."""
    return mixtral_name(name).replace(".mlp.router.", ".mlp.gate.")


def split_stacked(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor under the MoE layers' names: gpt-oss's stacked experts split one
    tensor per expert and projection (``gpt_oss_experts``), any other renamed (``qwen_name``)."""
    m = GPT_OSS_EXPERTS.match(name)
    if m is None:
        yield qwen_name(name), t
    else:
        yield from gpt_oss_experts(m.group(1), m.group(2), t, m.group(3))


def gpt_oss_experts(layer: str, proj: str, t: torch.Tensor, suffix: str | None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts as one tensor per expert and projection, with gate and up
    apart. ``gate_up_proj`` [experts, hidden, 2 inter] holds x -> [gate, up] with gate and up
    interleaved (even, odd columns); ``down_proj`` [experts, inter, hidden]; their biases
    [experts, 2 inter] and [experts, hidden]. Weights come out [out, in]. MXFP4 ``_blocks``
    [experts, out, in / 32, 16] and ``_scales`` [experts, out, in / 32] are rows already:
    split the same way along their rows, kept as they are (``formats.mxfp4``)."""
    rows_first = suffix in ("_bias", "_blocks", "_scales")
    for e in range(t.shape[0]):
        w = t[e] if rows_first else t[e].t()
        pre, part = f"{layer}.mlp.experts.{e}", _SPLIT_SUFFIX[suffix]
        if proj == "gate_up_proj":
            yield f"{pre}.gate_proj.{part}", w[0::2].contiguous()
            yield f"{pre}.up_proj.{part}", w[1::2].contiguous()
        else:
            yield f"{pre}.down_proj.{part}", w.contiguous()
