"""The server against the official openai client, compared with the offline engine."""

from __future__ import annotations

from typing import Any

import pytest

from qpage import SamplingParams
from tests.server.conftest import MODEL, Server
from tests.server.http import raw

PROMPT = "The three most common colors of the rainbow are"
CHAT = [{"role": "user", "content": "Name three fruits, one per line."}]


@pytest.fixture(scope="module")
def offline(llm_factory: Any) -> Any:
    """The offline engine on what the server runs: the default model's GGUF, natively."""
    return llm_factory(model=None)


def test_models_and_health(client: Any, server: Server) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert raw(server.url, "/health", key=None) == (200, {"status": "ok"})


def test_completion_matches_offline_engine(client: Any, offline: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, logprobs=3), use_tqdm=False)[0]
    out = ref.outputs[0]
    choice = r.choices[0]
    assert choice.text == out.text
    assert choice.finish_reason == out.finish_reason
    # usage: the prompt's token count and one completion token per logprob entry
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(out.token_ids) == len(choice.logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for lp_srv, tok, entry in zip(choice.logprobs.token_logprobs, out.token_ids, out.logprobs, strict=True):
        assert lp_srv == pytest.approx(entry[tok].logprob, abs=1e-4)
    assert all(len(top) >= 3 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_batch_prompts_and_token_ids(client: Any, server: Server) -> None:
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
              for p in (PROMPT, "Water boils at")]
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "Water boils at"], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == single
    ids = raw(server.url, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == single[0]


def test_chat_stream_equals_non_stream_with_n2(client: Any) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 40, "temperature": 0, "n": 2}
    full = client.chat.completions.create(**kw)
    texts = {c.index: c.message.content for c in full.choices}
    assert len(texts) == 2 and all(texts.values())
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert {i: "".join(p) for i, p in parts.items()} == texts
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_matches_offline_chat(client: Any, offline: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                       logprobs=True, top_logprobs=2)
    ref = offline.chat(CHAT, SamplingParams(max_tokens=30, temperature=0, logprobs=2), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.outputs[0].token_ids)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_stop_string(client: Any) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 4, base
    stop = words[3]
    cut = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == cut


def test_seeded_sampling_is_reproducible(client: Any) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 7,
          "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}}
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_tokenize_detokenize_roundtrip(server: Server) -> None:
    st, tok = raw(server.url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert st == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    st, detok = raw(server.url, "/detokenize", {"tokens": tok["tokens"]})
    assert st == 200 and detok["prompt"] == PROMPT
    st, chat = raw(server.url, "/tokenize", {"messages": CHAT})
    assert st == 200 and chat["count"] > tok["count"]
