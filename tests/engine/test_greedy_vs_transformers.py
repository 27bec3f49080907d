"""Greedy qpage == greedy transformers, token for token, on the real default model.

16 prompts of different lengths (English and Chinese, some sharing a long prefix), under
four engine set-ups: prefix caching on, off, a small token budget that forces chunked
prefill, and a small KV cache that forces preemptions. A divergence is excused only at a
near-tie, by tests.helpers' shared rule: where both transformers' and qpage's scores for the
two picks differ by less than 1e-3 (both fp32; reported).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qpage import SamplingParams
from qpage.engine.outputs import CompletionOutput, Logprob
from tests.helpers import assert_greedy_agrees, first_parting

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

MAX_NEW = 24
NEAR_TIE = 1e-3
STORY = ("The old lighthouse keeper had watched the sea for forty years. Every night he climbed "
         "the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the river,",
    "1, 2, 3, 4,",
    "中国的首都是",
    "请用一句话介绍你自己。",
    "The three primary colors are",
    "Translate to French: Good morning, my friend.",
    STORY + "One stormy night,",
    STORY + "He had a cat named",
    STORY * 3 + "The keeper's greatest fear was",
    STORY * 6 + "In the end,",
    "Water boils at a temperature of",
    "今天天气很好，我们去",
    "A haiku about autumn:\n",
    "Q: What is 12 times 12?\nA:",
]

SETUPS = {
    "prefix-cache-on": dict(enable_prefix_caching=True, kv_cache_memory="512MiB"),
    "prefix-cache-off": dict(enable_prefix_caching=False, kv_cache_memory="512MiB"),
    "chunked-prefill": dict(max_num_batched_tokens=48, kv_cache_memory="512MiB"),
    # 40 blocks x 16 = 640 tokens for 16 requests of up to ~330 tokens: preemptions.
    "preemption": dict(kv_cache_memory=40 * 16 * 46080, max_model_len=512),
}


@pytest.fixture(scope="module")
def hf_greedy(hf_model: Any, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) from transformers, one prompt at a time (no padding)."""
    torch.set_num_threads(2)
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tokenizer(p, return_tensors="pt").input_ids
            gen = hf_model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
            out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def hf_completion(hf_model: Any, prompt_ids: list[int], want: list[int], i: int, alt: int) -> CompletionOutput:
    """transformers' greedy tokens as a completion whose logprobs at ``i`` hold its pick and ``alt``."""
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([prompt_ids + want[:i]])).logits[0, -1].double(), -1)
    logprobs: list[dict[int, Logprob]] = [{t: Logprob(0.0)} for t in want]
    if i < len(want):
        logprobs[i] = {t: Logprob(float(lp[t])) for t in (want[i], alt)}
    return CompletionOutput(0, "", want, None, logprobs)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_matches_transformers(setup: str, llm_factory: Any, hf_model: Any,
                                     hf_greedy: list) -> None:
    llm = llm_factory(**SETUPS[setup])
    before = llm.get_metrics()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in hf_greedy], params, use_tqdm=False)
    after = llm.get_metrics()
    excused = []
    for (prompt_ids, want), out in zip(hf_greedy, outs, strict=True):
        got = out.outputs[0]
        i = first_parting(want, got.token_ids)
        if i is None:
            continue
        alt = got.token_ids[i] if i < len(got.token_ids) else -1
        ref = hf_completion(hf_model, prompt_ids, want, i, alt)
        assert_greedy_agrees(ref, got, NEAR_TIE)
        excused.append((i, float(ref.logprobs[i][want[i]].logprob - ref.logprobs[i][alt].logprob)))
    if excused:
        print(f"[{setup}] near-tie divergences excused: {excused}")
    assert len(excused) <= 2, f"[{setup}] too many near-tie divergences: {excused}"
    if setup == "preemption":
        assert after["qpage:num_preemptions_total"] > before["qpage:num_preemptions_total"]
    if setup == "prefix-cache-on":
        assert after["qpage:prefix_cache_hits"] > before["qpage:prefix_cache_hits"]
    if setup == "prefix-cache-off":
        assert after["qpage:prefix_cache_hits"] == 0
    assert after["qpage:kv_cache_usage_perc"] == 0.0
