"""A shared ~200-token system prompt over 8 requests: hits rise, outputs do not change."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from qpage import SamplingParams

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

SYSTEM = ("You are a careful assistant for a public library. " * 20).strip()
QUESTIONS = ["What are your opening hours?", "How do I renew a book?", "Can I print documents?",
             "Do you have audiobooks?", "Where is the children's section?", "Is there wifi?",
             "How many books can I borrow?", "Can I reserve a study room?"]


def test_shared_system_prompt_hits_cache_and_keeps_outputs(llm_factory: Any, tokenizer: Any) -> None:
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    n_sys = len(tokenizer.encode(tokenizer.apply_chat_template(convs[0][:1], tokenize=False)))
    assert 190 <= n_sys <= 260, n_sys
    params = SamplingParams(temperature=0, max_tokens=16)
    on = llm_factory(enable_prefix_caching=True, kv_cache_memory="256MiB")
    off = llm_factory(enable_prefix_caching=False, kv_cache_memory="256MiB")
    want = [o.outputs[0].token_ids for o in off.chat(convs, params, use_tqdm=False)]
    hits = []
    got = []
    for conv in convs:  # one at a time: each request after the first finds the system prompt
        got.append(on.chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(on.get_metrics()["qpage:prefix_cache_hits"])
    assert got == want
    assert all(b > a for a, b in itertools.pairwise(hits[1:])), hits
    # Every request after the first reuses at least the system prompt's full blocks.
    assert hits[-1] - hits[0] >= 7 * (n_sys // 16) * 16
    m = on.get_metrics()
    assert m["qpage:prefix_cache_queries"] >= m["qpage:prefix_cache_hits"] > 0
