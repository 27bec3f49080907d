"""Every ggml type qpage reads, in files quantized by llama.cpp itself (tests/fixtures/gguf,
made by scripts/make_gguf_fixtures.py): a tiny random Llama with an untied LM head, and the
same shapes as a Qwen2 (q/k/v biases, rows in Hugging Face order) in Q8_0.

The reference is transformers' LlamaForCausalLM on the ``gguf`` package's dequantization of
each tensor, with llama.cpp's q/k row interleave undone here independently. Types with a
native kernel (all; Q3_K rewritten as Q6_K, Q2_K as Q8_0; the Q4_K_M mix too) run on it
with int8-quantized activations and are held to a mean KL below 0.01 nats (see
tests/formats/test_gguf_native.py); the others are dequantized once at load and run in fp32,
held to 2e-4 in the logits, as the converted folder is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from qpage import SamplingParams
from qpage.formats.gguf_model import hf_config
from qpage.formats.gguf_reader import GgufFile
from tests.helpers import RunnerHarness

gguf = pytest.importorskip("gguf")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
FILES = sorted(FIXTURES.glob("tiny-llama.*.gguf"))
NATIVE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_K_M"}
IDS = [1, 77, 300, 45, 511, 12, 130, 264, 90, 401, 2, 333]
NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def reference_logits(path: Path) -> torch.Tensor:
    f = GgufFile(path)
    cfg = hf_config(f)
    llama = f.metadata["general.architecture"] == "llama"
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state = {}
    for name, info in f.tensors.items():
        x = gguf.quants.dequantize(f.data(name), info.ggml_type).astype(np.float32).reshape(info.shape)
        parts = name.split(".")
        if parts[0] == "blk":
            if llama and parts[2] in ("attn_q", "attn_k"):
                h = heads if parts[2] == "attn_q" else kv
                out, inp = x.shape
                x = x.reshape(h, out // h // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)
            key = f"model.layers.{parts[1]}.{NAMES[parts[2]]}.{parts[3]}"
        else:
            key = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}[name]
        state[key] = torch.from_numpy(np.ascontiguousarray(x))
    skip = ("architectures", "torch_dtype", "quantization_config", "attention_bias")
    kwargs = {k: v for k, v in cfg.items() if k not in skip}
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)) if llama
             else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].double()


def test_fixtures_cover_every_type() -> None:
    kinds = {GgufFile(p).tensors["blk.0.attn_q.weight"].type_name for p in FILES}
    assert kinds == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


@pytest.mark.parametrize("path", FILES, ids=[p.name.split(".")[1] for p in FILES])
def test_file_matches_transformers_on_its_dequantized_weights(path: Path) -> None:
    kind = path.name.split(".")[1]
    h = RunnerHarness(path, num_blocks=8, max_len=64)
    paths = {m.kernel_path for m in h.model.modules() if hasattr(m, "kernel_path")}
    assert paths == ({"cpu-blocks"} if kind in NATIVE else {"cpu-dequantized", "dense"}), paths
    ours = h.step([(h.request("r", IDS), len(IDS))])["r"].double()
    ref = reference_logits(path)
    if kind in NATIVE:
        p_ref, p_ours = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
        assert (p_ref.exp() * (p_ref - p_ours)).sum(-1).mean() < 0.01
    else:
        assert (ours - ref).abs().max() < 2e-4


def test_qwen2_with_biases_runs_natively_and_fused(llm_factory: Any) -> None:
    """q/k/v biases on the native kernels (added after the matmul) and inside the fused step."""
    path = FIXTURES / "tiny-qwen2.Q8_0.gguf"
    h = RunnerHarness(path, num_blocks=8, max_len=64)
    assert h.arch.architecture == "Qwen2ForCausalLM" and h.arch.qkv_bias
    assert {m.kernel_path for m in h.model.modules() if hasattr(m, "kernel_path")} == {"cpu-blocks"}
    ours = h.step([(h.request("r", IDS), len(IDS))])["r"].double()
    p_ref, p_ours = torch.log_softmax(reference_logits(path), -1), torch.log_softmax(ours, -1)
    assert (p_ref.exp() * (p_ref - p_ours)).sum(-1).mean() < 0.01
    llm = llm_factory(model=str(path), kv_cache_memory="16MiB")
    model = llm.llm_engine.model
    assert model.decode_stack is not None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": IDS}, {"prompt_token_ids": IDS[:5]}]
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    stack, model.decode_stack = model.decode_stack, None
    try:
        python = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        model.decode_stack = stack
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        assert [{k: v.logprob for k, v in x.items()} for x in a.logprobs] == [
            {k: v.logprob for k, v in x.items()} for x in b.logprobs]
