"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, Mixtral as llama, gpt-oss), laid out as
llama.cpp's converter writes them: each layer's experts stacked in 3-d ``ffn_{gate,up,down}_exps``
tensors, the router ``ffn_gate_inp``, Qwen2-MoE's shared expert ``*_shexp`` and its gate
``ffn_gate_inp_shexp`` [hidden], Mixtral's q/k rows in llama.cpp's rotary order, gpt-oss's
biases, sinks, YaRN keys and alternating windowed layers.

Files are written here with the ``gguf`` package from tiny random transformers models (the
default model's tokenizer); F32 files must give transformers' logits (2e-4); Q8_0 files run
their experts on the C block and the whole decode step fused, within a mean KL of 0.01 of
transformers (int8 activations, as the other Q8_0 tests); MXFP4 experts run packed. benchmarks/gguf_moe.py compares
files made by llama.cpp's own converter and quantizer with llama.cpp's perplexity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from qpage.formats.gguf_model import permute_rows
from tests.formats.gguf_writing import TOP, assert_matches_reference, random_model, start_file
from tests.helpers import RunnerHarness

gguf = pytest.importorskip("gguf")
VOCAB = 49152
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, num_hidden_layers=2)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "intermediate_size": 96, "norm_topk_prob": True}),
    "qwen2moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "intermediate_size": 96, "shared_expert_intermediate_size": 64,
                                    "norm_topk_prob": False}),
    "llama": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                "sliding_window": None}),
    # An 8-token window under 40-token prompts, YaRN, sinks, biases, a SwiGLU limit reached.
    "gpt-oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "intermediate_size": 32, "sliding_window": 8, "swiglu_limit": 7.0,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                     "original_max_position_embeddings": 16}}),
}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
"mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.router": "ffn_gate_inp", "self_attn.sinks": "attn_sinks"}


def moe(arch: str, folder: Path, default_model_dir: Path, **shape: Any) -> transformers.PreTrainedModel:
    """A seeded random ``arch`` of ``SHAPE`` (``shape`` overrides it) and the default model's
    tokenizer files in ``folder``."""
    cls_name, extra = CONFIGS[arch]
    return random_model(getattr(transformers, cls_name)(**{**SHAPE, **extra, **shape}), folder, default_model_dir)


def gguf_tensors(arch: str, model: Any) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, experts stacked [experts, rows, cols] (as
    transformers holds them in memory: gate and up stacked in one ``gate_up_proj``)."""
    c = model.config
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        x = t.float().numpy()
        if name in TOP:
            out[TOP[name]] = x
            continue
        parts = name.split(".")
        layer, module = parts[2], ".".join(parts[3:-1])
        if arch == "gpt-oss":
            out.update(gpt_oss_tensors(layer, ".".join(parts[3:]), x))
            continue
        if name.endswith("experts.gate_up_proj"):
            inter = x.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = x[:, :inter]
            out[f"blk.{layer}.ffn_up_exps.weight"] = x[:, inter:]
            continue
        if name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = x
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
            x = permute_rows(x, heads)
        out[f"blk.{layer}.{LAYER[module]}.{parts[-1]}"] = x.reshape(-1) if module == "mlp.shared_expert_gate" else x
    return out


def gpt_oss_tensors(layer: str, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """One of gpt-oss's layer tensors under llama.cpp's names, as its converter writes them: the
    stacked experts' x -> [gate, up] columns (interleaved) transposed into gate and up rows, the
    norm after attention ``post_attention_norm``, sinks as ``attn_sinks.weight``."""
    pre = f"blk.{layer}."
    if name in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        t = x.transpose(0, 2, 1) if x.ndim == 3 else x
        kind = "weight" if x.ndim == 3 else "bias"
        return {f"{pre}ffn_gate_exps.{kind}": t[:, 0::2], f"{pre}ffn_up_exps.{kind}": t[:, 1::2]}
    if name == "mlp.experts.down_proj":
        return {f"{pre}ffn_down_exps.weight": x.transpose(0, 2, 1)}
    if name == "mlp.experts.down_proj_bias":
        return {f"{pre}ffn_down_exps.bias": x}
    if name == "self_attn.sinks":
        return {f"{pre}attn_sinks.weight": x}
    module, suffix = name.rsplit(".", 1)
    return {f"{pre}{'post_attention_norm' if module == 'post_attention_layernorm' else LAYER[module]}.{suffix}": x}


def write_moe_gguf(arch: str, model: Any, tokenizer_dir: Path, dest: Path, qtype: int,
                   expert_qtype: int | None = None) -> Path:
    """``model`` as llama.cpp's converter lays it out; 2-d and 3-d weights in ``qtype`` (experts
    in ``expert_qtype`` where given, as llama.cpp's MXFP4_MOE files), routers F32."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = start_file(dest, arch, c, tokenizer_dir, qtype == gguf.GGMLQuantizationType.Q8_0, head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "gpt-oss":
        rope = c.rope_parameters
        w.add_sliding_window(c.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    for name, x in gguf_tensors(arch, model).items():
        t = expert_qtype if expert_qtype is not None and "_exps" in name else qtype
        if t != gguf.GGMLQuantizationType.F32 and x.ndim >= 2 and "gate_inp" not in name and name.endswith("weight"):
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x), t), raw_dtype=t)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_moe_gguf_matches_transformers(tmp_path: Path, default_model_dir: Path, arch: str, qtype: str) -> None:
    model = moe(arch, tmp_path, default_model_dir)
    path = write_moe_gguf(arch, model, tmp_path, tmp_path / f"{arch}.{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    h = RunnerHarness(path, num_blocks=32, max_len=256)
    assert h.arch.architecture == type(model).__name__ and h.arch.num_experts == 8
    if qtype == "Q8_0":
        assert {m.kernel_path for m in h.model.quant_linears()} == {"cpu-blocks"}
        assert {m.experts_path for m in h.model.modules() if hasattr(m, "experts_path")} == {"cpu-native"}
        assert h.model.decode_stack is not None
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_matches_reference(h, model, ids, qtype)


def test_mxfp4_experts_run_packed(tmp_path: Path, default_model_dir: Path) -> None:
    """MXFP4 experts (the rest Q8_0, as llama.cpp's MXFP4_MOE files) on the C block, against the
    same file with its weights dequantized: the int8 activations alone part them (mean KL below
    1e-3)."""
    model = moe("qwen3moe", tmp_path, default_model_dir)
    path = write_moe_gguf("qwen3moe", model, tmp_path, tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0,
                          gguf.GGMLQuantizationType.MXFP4)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = []
    for deq in (False, True):
        h = RunnerHarness(path, num_blocks=32, max_len=256, dequantize_weights=deq)
        assert {m.experts_path for m in h.model.modules() if hasattr(m, "experts_path")} == {
            "torch" if deq else "cpu-native"}
        out.append(h.step([(h.request("a", ids), len(ids))])["a"])
    kl = torch.nn.functional.kl_div(out[0].log_softmax(-1), out[1].log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert float(kl.mean()) < 1e-3
