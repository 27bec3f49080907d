"""Gemma 2 and Gemma 3 GGUF files (``general.architecture`` gemma2, gemma3): norms stored as
``1 + w``, the norms after attention and MLP, local layers every n-th layer but the last,
Gemma 3's local rope base and linear scaling on its global layers, Gemma 2's soft caps.

The files are written here with the ``gguf`` package under llama.cpp's tensor names and keys,
as its converter lays them out, from tiny random transformers models (with the default
model's tokenizer); F32 files must give transformers' logits (2e-4) on prompts several windows
long, Q8_0 files run on the packed kernels within a mean KL of 0.01.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.formats.gguf_writing import assert_matches_reference, random_model, start_file, write_tensors_and_close
from tests.helpers import RunnerHarness

gguf = pytest.importorskip("gguf")
VOCAB = 49152
WINDOW = 8
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, max_position_embeddings=256)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 4, "attn_logit_softcapping": 1.5,
                                "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
}


def gemma(arch: str, folder: Path, default_model_dir: Path, **shape: Any) -> transformers.PreTrainedModel:
    """A seeded random ``arch`` of ``SHAPE`` (``shape`` overrides it) and the default model's
    tokenizer files in ``folder``."""
    cls_name, extra = CONFIGS[arch]
    return random_model(getattr(transformers, cls_name)(**{**SHAPE, **extra, **shape}), folder, default_model_dir)


def write_gemma_gguf(arch: str, model: Any, tokenizer_dir: Path, dest: Path, qtype: int) -> Path:
    """``model`` as llama.cpp's converter lays a Gemma out: every norm weight plus one, the
    gemma*.* keys; 2-d weights in ``qtype``, the rest F32."""
    c = model.config
    w = start_file(dest, arch, c, tokenizer_dir, qtype == gguf.GGMLQuantizationType.Q8_0, c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    write_tensors_and_close(w, model.state_dict(), NAMES, qtype, norm_shift=1.0, skip=("lm_head.weight",))
    return dest


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_gemma_gguf_matches_transformers(tmp_path: Path, default_model_dir: Path, arch: str, qtype: str) -> None:
    model = gemma(arch, tmp_path, default_model_dir)
    path = write_gemma_gguf(arch, model, tmp_path, tmp_path / f"{arch}.{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    h = RunnerHarness(path, num_blocks=32, max_len=256)
    assert h.arch.layer_types == tuple(model.config.layer_types)
    if qtype == "Q8_0":
        assert {m.kernel_path for m in h.model.quant_linears()} == {"cpu-blocks"}
    ids = torch.randint(0, VOCAB, (5 * WINDOW,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_matches_reference(h, model, ids, qtype)
