"""Gemma 2 and Gemma 3 through the engine: greedy tokens and prompt logprobs against
transformers, and on Gemma 3 (five local layers of a 16-token window, one global) the same
outputs under preemption, prefix caching and chunked prefill as a roomy run, on prompts several
windows long.

The models are tiny and random (seeded), with the default model's tokenizer. Tolerances: fp32
on both sides; prompt logprobs within 1e-3 (the issue's bound; observed differences are near
1e-5); greedy tokens equal up to a near-tie (``tests.helpers.assert_greedy_agrees``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from qpage import LLM, SamplingParams
from tests.helpers import assert_greedy_agrees

WINDOW = 16
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, sliding_window=WINDOW, max_position_embeddings=1024)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 4, "attn_logit_softcapping": 4.0,
                                "final_logit_softcapping": 8.0}),
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6}),
}
MAX_NEW = 12


def _build(folder: Path, default_model_dir: Path, family: str) -> transformers.PreTrainedModel:
    cls_name, extra = CONFIGS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**SHAPE, **extra, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # stronger weights than the default init, so that the logits are not flat
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((default_model_dir / name).read_bytes())
    return model


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, tuple[Path, Any]]:
    out = {}
    for family in CONFIGS:
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, _build(folder, default_model_dir, family))
    return out


def _prompts(n: int = 8) -> list[list[int]]:
    """Prompts of 20 to 90 tokens (1 to 6 windows), two pairs sharing a 48-token prefix."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 49152, (48,), generator=g).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(20, 90, (1,), generator=g))
        ids = torch.randint(3, 49152, (length,), generator=g).tolist()
        out.append(shared + ids[:length - 48] if i in (2, 3, 5, 6) and length > 56 else ids)
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_and_prompt_logprobs_match_transformers(gemma_models: dict, family: str) -> None:
    folder, ref = gemma_models[family]
    prompts = _prompts()
    llm = LLM(model=str(folder), kv_cache_memory="64MiB", log_stats=False)
    assert llm.llm_engine.arch.layer_types is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
            want_ids = gen.sequences[0, len(ids):].tolist()
            lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1], -1)
        want_prompt = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got_prompt = torch.tensor([next(iter(d.values())).logprob if t is None else d[t].logprob
                                   for t, d in zip(ids[1:], out.prompt_logprobs[1:], strict=True)])
        torch.testing.assert_close(got_prompt, want_prompt, atol=1e-3, rtol=0)
        want = _completion(ref, ids, want_ids)
        assert_greedy_agrees(want, out.outputs[0])


def _completion(ref: Any, ids: list[int], want: list[int]) -> Any:
    """transformers' greedy tokens with their top-5 logprobs at each step (assert_greedy_agrees' input)."""
    from qpage.engine.outputs import CompletionOutput, Logprob

    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids + want])).logits[0, len(ids) - 1 : -1].double(), -1)
    top = lp.topk(5, dim=-1)
    logprobs = [{int(t): Logprob(float(v)) for t, v in zip(top.indices[i], top.values[i], strict=True)}
                for i in range(len(want))]
    return CompletionOutput(0, "", want, None, logprobs)


def _tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_gemma3_preemption_prefix_caching_and_chunks_match_a_roomy_run(gemma_models: dict) -> None:
    folder, _ = gemma_models["gemma3"]
    prompts = [{"prompt_token_ids": p} for p in _prompts(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = {"model": str(folder), "log_stats": False, "max_model_len": 256}
    want = _tokens(LLM(**base, kv_cache_memory="64MiB", enable_prefix_caching=False).generate(
        prompts, params, use_tqdm=False))
    block = 2 * 6 * 2 * 16 * 4 * 16  # a full-cache block: K and V, 6 layers, 2 kv heads x 16, fp32, 16 tokens
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    for setup in ({"kv_cache_memory": 24 * block}, {"kv_cache_memory": "64MiB", "enable_prefix_caching": True},
                  {"kv_cache_memory": "64MiB", "max_num_batched_tokens": 24},
                  {"kv_cache_memory": "64MiB", "speculative_config": ngram}):
        llm = LLM(**base, **setup)
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want, setup
        m = llm.get_metrics()
        if setup["kv_cache_memory"] != "64MiB":
            assert m["qpage:num_preemptions_total"] > 0, m
        if setup.get("enable_prefix_caching"):
            assert m["qpage:prefix_cache_hits"] > 0, m


def test_gemma3_holds_its_windows_not_its_whole_context(gemma_models: dict) -> None:
    """Four requests of 8 windows (128 tokens) at once: the engine's metrics show the blocks
    held against those a cache without windows would hold, at every step. Bound: the global
    layer's 8 blocks per request and 2 per local layer (a 16-token window and the next token
    span at most 2 blocks)."""
    folder, _ = gemma_models["gemma3"]
    llm = LLM(model=str(folder), kv_cache_memory="64MiB", max_model_len=1024, log_stats=False)
    eng = llm.llm_engine
    assert [g.window for g in eng.layout.groups] == [None] + [WINDOW] * 5
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(3, 49152, (8 * WINDOW - 28,), generator=g).tolist()
        eng.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
    peak = (0, 0)
    while eng.has_unfinished_requests():
        eng.step()
        m = eng.get_metrics()
        held, full = m["qpage:kv_cache_blocks_held"], m["qpage:kv_cache_blocks_without_windows"]
        assert held <= full
        peak = max(peak, (full, held))
    full, held = peak
    assert full == 4 * 6 * 8  # 6 groups x 8 blocks of 16 tokens, each request
    assert held <= 4 * (8 + 5 * 2), peak
