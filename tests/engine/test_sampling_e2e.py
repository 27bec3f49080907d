"""Sampling features end to end on the real default model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qpage import SamplingParams

PROMPT = "Once upon a time, a little robot who wanted to paint"


@pytest.mark.slow
def test_seed_reproduces_whatever_else_is_batched(llm: Any) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.7, max_tokens=10, seed=5)]
    batch = llm.generate(["Hello there", PROMPT, "中文的句子"], [others[0], p, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    diff = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=99),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert diff != alone


def test_n_returns_n_distinct_completions(llm: Any) -> None:
    p = SamplingParams(n=4, temperature=1.0, max_tokens=20, min_tokens=8, seed=3)
    out = llm.generate("The robot picked up the brush and", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = {tuple(c.token_ids) for c in out.outputs}
    assert len(seqs) == 4, [c.text for c in out.outputs]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)


def test_stop_string_stops_and_is_excluded_unless_asked(llm: Any) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    words = full.split()
    stop = words[len(words) // 2]
    cut = full.index(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "never-there"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: cut + len(stop)]


def test_stop_token_ids_and_max_tokens_and_ignore_eos(llm: Any) -> None:
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    tok = full.token_ids[5]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok]),
                       use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(tok)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    # A chat answer ends with EOS; ignore_eos runs past it to max_tokens, min_tokens delays it.
    msgs = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.stop_reason is None
    n = len(short.token_ids)
    longer = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False)
    assert len(longer[0].outputs[0].token_ids) == n + 5
    delayed = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 2), use_tqdm=False)
    assert len(delayed[0].outputs[0].token_ids) >= n + 2


def test_logprobs_match_log_softmax_of_transformers_logits(llm: Any, hf_model: Any) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    p = len(out.prompt_token_ids)
    assert len(comp.logprobs) == 8
    total = 0.0
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[p - 1 + i]
        assert abs(lp[tok].logprob - float(row[tok])) < 1e-3
        assert lp[tok].rank == 1  # greedy picks the top token
        top = row.topk(5).indices.tolist()
        assert set(top) <= set(lp), (top, list(lp))
        for t in top:
            assert abs(lp[t].logprob - float(row[t])) < 1e-3
        assert lp[tok].decoded_token == llm.get_tokenizer().decode([tok])
        total += lp[tok].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
    for j in range(1, p):
        entry = out.prompt_logprobs[j]
        assert abs(entry[ids[j]].logprob - float(ref[j - 1, ids[j]])) < 1e-3
        assert len(entry) >= 3


def test_stop_strings_wait_for_min_tokens(llm: Any) -> None:
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    first_word = full.text.split()[0]
    early = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=first_word),
                         use_tqdm=False)[0].outputs[0]
    assert early.text == full.text[: full.text.index(first_word)]
    late = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=first_word, min_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10 and late.text.startswith(full.text[: full.text.index(first_word) + 1])
