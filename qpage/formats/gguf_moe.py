"""Mixture-of-experts GGUF files as llama.cpp writes them: ``qwen2moe``, ``qwen3moe``,
``gpt-oss`` and Mixtral (``llama`` with ``expert_count``).

Each sparse layer stores its experts as 3-d tensors ``ffn_{gate,up,down}_exps`` [experts,
rows, cols], expert e's rows contiguous (whole rows of blocks), which are read as one 2-d
weight per expert without copying; the router is ``ffn_gate_inp`` [experts, hidden], and
Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` with its gate ``ffn_gate_inp_shexp``
[hidden]; gpt-oss's biases on the router and experts (``*.bias``, [experts, rows]) and its
attention sinks ``attn_sinks``. A layer without ``ffn_gate_inp`` is dense. Routing as llama.cpp's
graphs: Qwen3-MoE, Mixtral and gpt-oss renormalise the chosen experts' weights, Qwen2-MoE does not.
"""

from __future__ import annotations

from typing import Any

from qpage.formats.gguf_reader import GgufFile, GgufFormatError

MOE_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                     "gpt-oss": "GptOssForCausalLM"}
"""GGUF ``general.architecture`` of the MoE families named apart (Mixtral files say "llama")."""
MIXTRAL = "MixtralForCausalLM"
"""What a ``llama`` file with experts runs as."""
NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "llama": True, "gpt-oss": True}
"""Whether llama.cpp's graph for the architecture renormalises the chosen experts' weights."""
MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate", "attn_sinks": "self_attn.sinks",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""3-d tensors holding every expert's projection -> the projection's name in each expert."""


def is_moe(f: GgufFile, arch: str) -> bool:
    """Whether the file is a mixture of experts (its architecture, or an expert count)."""
    return arch in MOE_ARCHITECTURES or bool(f.get(f"{arch}.expert_count"))


def moe_config(f: GgufFile, arch: str, layers: int) -> dict[str, Any]:
    """The config fields of an MoE file (``models.arch._moe`` reads them)."""
    experts = int(f.require(f"{arch}.expert_count"))
    scale = f.get(f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 0.0, 1, 1.0):
        raise GgufFormatError(f"{f.path}: {arch}.expert_weights_scale={scale} (scaled routing weights) is not "
                              "supported")
    if arch not in NORM_TOPK:
        raise GgufFormatError(f"{f.path}: experts in a {arch!r} file are not supported; qpage runs the experts of "
                              "qwen2moe, qwen3moe and Mixtral (llama) files")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
    expert_width = f.get(f"{arch}.expert_feed_forward_length") or f.require(f"{arch}.feed_forward_length")
    out: dict[str, Any] = {
        "architectures": [MOE_ARCHITECTURES.get(arch, MIXTRAL)], "num_experts": experts,
        "num_experts_per_tok": int(f.require(f"{arch}.expert_used_count")), "norm_topk_prob": NORM_TOPK[arch],
        "moe_intermediate_size": int(expert_width), "mlp_only_layers": dense,
        "shared_expert_intermediate_size": int(f.get(f"{arch}.expert_shared_feed_forward_length") or 0),
    }
    if arch == "llama" and dense:
        raise GgufFormatError(f"{f.path}: a Mixtral file needs experts in every layer; layers {dense} have none")
    if arch in ("llama", "gpt-oss"):
        out["intermediate_size"] = int(expert_width)
    if arch == "gpt-oss":  # local layers first, then every other one (llama.cpp's pattern of 2)
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return out


def expert_names(layer: str, kind: str, experts: int, suffix: str = "weight") -> list[str]:
    """Hugging Face names of expert e's projection (its ``suffix``: weight or bias) for e <
    experts (``kind`` of ``EXPERT_TENSORS``)."""
    return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_TENSORS[kind]}.{suffix}" for e in range(experts)]
