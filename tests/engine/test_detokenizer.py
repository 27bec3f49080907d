"""Incremental detokenization is exact for multi-byte UTF-8 (Chinese, emoji)."""

from __future__ import annotations

from typing import Any

import pytest

from qpage import SamplingParams
from qpage.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["你好，世界！今天我们学习分页注意力。", "Party 🎉🎊 time 👩‍👩‍👧 done ✅", "naïve café — 東京 🚀!"]


def test_token_by_token_equals_full_decode(tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), True, [], False)
        seen = []
        for t in ids:
            d.add_token(t)
            assert "\ufffd" not in d.text
            seen.append(d.text)
        assert d.text == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert all(seen[-1].startswith(s) for s in seen)  # append-only
    # Several emoji are split into byte tokens: the window must hold them back.
    assert any(len(tokenizer.decode([t])) and "\ufffd" in tokenizer.decode([t])
               for t in tokenizer.encode(TEXTS[1]))


def test_stop_string_spanning_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    d = IncrementalDetokenizer(tokenizer, [], True, ["a gam"], False)
    hit = None
    for t in ids:
        hit = d.add_token(t) or hit
        if hit:
            break
    assert hit == "a gam" and d.text == "alpha bet"


@pytest.mark.slow
def test_streamed_outputs_are_exact_for_chinese_and_emoji(llm: Any, tokenizer: Any) -> None:
    engine = llm.llm_engine
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=40)
    # The small model continues these in kind: CJK and multi-token emoji in the output.
    rid = engine.add_request("中文：我爱你。中文：我爱你。中文：", p)
    rid2 = engine.add_request("🎉🎉🎉🎉🎉🎉🎉🎉", p)
    texts: dict[str, list[str]] = {rid: [], rid2: []}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
            final[out.request_id] = out
    for r in (rid, rid2):
        assert final[r].finished
        comp = final[r].outputs[0]
        assert comp.text == tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        # Streamed text only grows and never shows a half character; the final text equals a
        # full decode, which ends in U+FFFD only if generation stopped inside a character.
        assert all(comp.text.startswith(t) and "\ufffd" not in t for t in texts[r][:-1])
    assert any(0x4E00 <= ord(ch) <= 0x9FFF for ch in final[rid].outputs[0].text)  # CJK produced
    assert any(ord(ch) >= 0x1F300 for ch in final[rid2].outputs[0].text)  # emoji produced
