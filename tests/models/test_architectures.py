"""Each supported architecture, as a tiny random-weight model, against transformers' logits.

Tolerance: fp32 both sides, |qpage - transformers| <= 2e-4 absolute on logits of order 1
(the two differ only in summation order: fused projections, paged attention).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import RunnerHarness

ATOL = 2e-4
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}

CASES = {
    "llama-gqa-untied": ("LlamaConfig", {}),
    "llama-tied-bias": ("LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("LlamaConfig",
                          {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2-qkv-bias": ("Qwen2Config", {}),
    "qwen3-qk-norm": ("Qwen3Config", {"head_dim": 32}),
}


def build(tmp_path: Path, cls_name: str, extra: dict) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # larger than default init so errors would show in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_logits_match_transformers(tmp_path: Path, case: str) -> None:
    cls_name, extra = CASES[case]
    model_dir, ref = build(tmp_path, cls_name, extra)
    h = RunnerHarness(model_dir, num_blocks=32)
    g = torch.Generator().manual_seed(1)
    prompts = {"a": torch.randint(0, 256, (21,), generator=g).tolist(),
               "b": torch.randint(0, 256, (7,), generator=g).tolist()}
    reqs = {k: h.request(k, v) for k, v in prompts.items()}
    # Prefill: "a" in two chunks (the second reads the first from the paged cache), "b" whole.
    got = h.step([(reqs["a"], 13), (reqs["b"], 7)])
    got_a2 = h.step([(reqs["a"], 8)])
    with torch.no_grad():
        want_a = ref(torch.tensor([prompts["a"]])).logits[0]
        want_b = ref(torch.tensor([prompts["b"]])).logits[0]
    torch.testing.assert_close(torch.cat([got["a"], got_a2["a"]]), want_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(got["b"], want_b, atol=ATOL, rtol=0)
    # Eight decode steps for both at once (the batched, padded decode path).
    for _ in range(8):
        for k, r in reqs.items():
            r.append_token(int(torch.randint(0, 256, (1,), generator=g)))
            prompts[k] = r.all_token_ids
        got = h.step([(reqs["a"], 1), (reqs["b"], 1)])
        with torch.no_grad():
            for k in reqs:
                want = ref(torch.tensor([prompts[k]])).logits[0, -1:]
                torch.testing.assert_close(got[k], want, atol=ATOL, rtol=0, msg=f"{case} seq {k}")


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    from qpage.models.arch import parse_arch_config

    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        parse_arch_config({"architectures": ["GPT2LMHeadModel"]})


def test_dynamic_rope_is_refused_with_reason(tmp_path: Path) -> None:
    model_dir, _ = build(tmp_path, "LlamaConfig",
                         {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="dynamic"):
        RunnerHarness(model_dir)
