"""Phi-3 GGUF files (``general.architecture`` phi3): fused ``attn_qkv`` and ``ffn_up`` (gate then
up), LongRoPE from ``rope_factors_long/short.weight`` and the ``phi3.rope.scaling.*`` keys.

The files are written here with the ``gguf`` package under llama.cpp's tensor names and keys,
from a tiny random transformers Phi3 (with the default model's tokenizer); F32 files must give
transformers' logits (2e-4), Q8_0 files run on the packed kernels within a mean KL of 0.01. The
prompt runs past original_max_position_embeddings under a context that does too, so the long
factors are the ones in use on both sides.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from qpage.formats.gguf_reader import GgufFormatError
from tests.formats.gguf_writing import random_model, start_file, write_tensors_and_close
from tests.helpers import RunnerHarness

gguf = pytest.importorskip("gguf")
ORIGINAL = 32
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)]}
NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def phi3(folder: Path, default_model_dir: Path, vocab: int) -> transformers.PreTrainedModel:
    cfg = transformers.Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  sliding_window=None, pad_token_id=0, rope_parameters=LONGROPE,
                                  original_max_position_embeddings=ORIGINAL)
    return random_model(cfg, folder, default_model_dir)


def write_phi3_gguf(model: Any, tokenizer_dir: Path, dest: Path, qtype: int, rotary: int | None = None) -> Path:
    """``model`` as llama.cpp's converter lays a Phi-3 out: phi3.* keys, global rope factor
    tensors, fused attn_qkv and ffn_up; 2-d weights in ``qtype``, the rest F32."""
    c = model.config
    w = start_file(dest, "phi3", c, tokenizer_dir, qtype == gguf.GGMLQuantizationType.Q8_0)
    head_dim = c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(rotary or head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_uint32("phi3.rope.scaling.original_context_length", ORIGINAL)
    w.add_float32("phi3.rope.scaling.attn_factor",
                  math.sqrt(1 + math.log(c.max_position_embeddings / ORIGINAL) / math.log(ORIGINAL)))
    w.add_tensor("rope_factors_long.weight", np.array(LONGROPE["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(LONGROPE["short_factor"], dtype=np.float32))
    write_tensors_and_close(w, model.state_dict(), NAMES, qtype)
    return dest


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_phi3_gguf_matches_transformers(tmp_path: Path, default_model_dir: Path, qtype: str) -> None:
    model = phi3(tmp_path, default_model_dir, 49152)
    path = write_phi3_gguf(model, tmp_path, tmp_path / f"phi3.{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    h = RunnerHarness(path, num_blocks=32, max_len=256)
    assert h.arch.architecture == "Phi3ForCausalLM"
    assert h.arch.rope_scaling["long_factor"] == pytest.approx(LONGROPE["long_factor"], rel=1e-6)
    if qtype == "Q8_0":
        assert {m.kernel_path for m in h.model.quant_linears()} == {"cpu-blocks"}
    ids = torch.randint(0, 49152, (ORIGINAL + 20,), generator=torch.Generator().manual_seed(1)).tolist()
    got = h.step([(h.request("a", ids), len(ids))])["a"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    if qtype == "F32":
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    else:  # Q8_0 weights and int8 activations, as tests/formats/test_gguf_fixtures.py holds them
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)
        assert float(kl.mean()) < 0.01


def test_partial_rotary_gguf_is_refused_by_name(tmp_path: Path, default_model_dir: Path) -> None:
    model = phi3(tmp_path, default_model_dir, 49152)
    path = write_phi3_gguf(model, tmp_path, tmp_path / "partial.gguf", gguf.GGMLQuantizationType.F32, rotary=12)
    with pytest.raises(GgufFormatError, match="partial rotary"):
        RunnerHarness(path)
