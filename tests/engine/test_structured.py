"""Structured outputs in the offline API: every constraint kind yields output that parses
and matches it (sampled at temperature 1.0), free requests are untouched by constrained
neighbours, a preempted constrained request resumes its grammar, and bad constraints fail
with the constraint named."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from qpage import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from qpage.engine.structured import Guide, check_constraint, choice_grammar, token_masks
from qpage.runner.sampler import apply_bitmask

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 3}}}


def _texts(llm: Any, so: StructuredOutputsParams, n: int = 4, max_tokens: int = 200, **kw: Any) -> list[Any]:
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=max_tokens, structured_outputs=so, **kw)
    return llm.chat([CHAT], params, use_tqdm=False)[0].outputs


def test_json_schema_outputs_validate(llm: Any) -> None:
    for c in _texts(llm, StructuredOutputsParams(json=PERSON)):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_json_text_and_compact_whitespace(llm: Any) -> None:
    so = StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True)
    for c in _texts(llm, so, n=2):
        jsonschema.validate(json.loads(c.text), PERSON)
        assert "\n" not in c.text and "  " not in c.text  # one space after ':' and ',', none elsewhere


def test_regex_choice_grammar_and_json_object(llm: Any) -> None:
    for c in _texts(llm, StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}-[0-9]{2}")):
        assert re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{2}", c.text), c.text
    choices = ['say "yes"', "no\\way", "maybe so"]  # quotes and backslashes are escaped in the grammar
    for c in _texts(llm, StructuredOutputsParams(choice=choices)):
        assert c.text in choices
    for c in _texts(llm, StructuredOutputsParams(grammar='root ::= "Answer: " [0-9]+ ("." [0-9])?')):
        assert re.fullmatch(r"Answer: [0-9]+(\.[0-9])?", c.text), c.text
    done = [c for c in _texts(llm, GuidedDecodingParams(json_object=True), max_tokens=300)
            if c.finish_reason == "stop"]  # an object may run past max_tokens at temperature 1.0
    assert done and all(isinstance(json.loads(c.text), dict) for c in done)


def test_guided_decoding_is_the_older_name(llm: Any) -> None:
    a = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    b = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["x", "y"]))
    assert b.structured_outputs == a.structured_outputs and b.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=a.structured_outputs, guided_decoding=a.structured_outputs)
    outs = llm.chat([CHAT, CHAT], [a, b], use_tqdm=False)
    assert outs[0].outputs[0].text == outs[1].outputs[0].text in ("x", "y")


def test_length_inside_an_object(llm: Any) -> None:
    c = _texts(llm, StructuredOutputsParams(json=PERSON), n=1, max_tokens=4)[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(c.text)


def test_min_tokens_does_not_block_the_grammar_end(llm: Any) -> None:
    c = _texts(llm, StructuredOutputsParams(choice=["yes", "no"]), n=1, min_tokens=10)[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_stop_strings_and_tokens_do_not_cut_a_constrained_output(llm: Any, tokenizer: Any) -> None:
    """The grammar decides where a constrained output ends: "}" and its token would cut the
    JSON in the middle (a nested object), so they are ignored."""
    so = StructuredOutputsParams(json={"type": "object", "required": ["who"], "properties": {"who": PERSON}})
    brace = tokenizer.convert_tokens_to_ids("}")
    outs = _texts(llm, so, n=3, stop=["}", '"'], stop_token_ids=[brace])
    for c in outs:
        assert c.finish_reason == "stop" and c.stop_reason is None, (c.text, c.stop_reason)
        jsonschema.validate(json.loads(c.text), so.json)
    free = llm.generate("JSON: {", SamplingParams(temperature=0, max_tokens=40, stop=['"']), use_tqdm=False)
    assert free[0].outputs[0].stop_reason == '"'  # unconstrained, stop strings still apply


LATE_AMBIGUOUS = StructuredOutputsParams(grammar='root ::= [0-9]{80} s\ns ::= s s | "a" | "b" | "c"')
"""Ambiguous past 80 digits: it passes the compile-time walk (64 tokens), so the per-step budget ends it."""


def test_a_grammar_too_costly_to_follow_ends_alone(llm: Any) -> None:
    """Past its digits the grammar's matcher grows slower with every token; past its share of a
    step the request is ended as the client's error, within tens of tokens (not its 400), and a
    free neighbour goes on with the tokens it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    alone = llm.generate("The history of printing", free, use_tqdm=False)[0].outputs[0].token_ids
    hostile = SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=400, structured_outputs=LATE_AMBIGUOUS)
    bad, good = llm.generate(["x", "The history of printing"], [hostile, free], use_tqdm=False)
    assert bad.client_error and "too ambiguous to follow in bounded time" in (bad.error or "")
    assert all(c.finish_reason == "error" and len(c.token_ids) < 200 for c in bad.outputs)
    assert good.error is None and good.outputs[0].token_ids == alone


def test_a_constraint_that_runs_into_characters_the_vocabulary_lacks_ends_alone(llm: Any) -> None:
    """Past its digits the regex needs U+44A48, whose first byte no token of the vocabulary
    holds: the request ends as the client's error when its mask allows no token, and a free
    neighbour goes on with the tokens it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate("The history of printing", free, use_tqdm=False)[0].outputs[0].token_ids
    dead = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{80}\u00e2\U00044a48"))
    bad, good = llm.generate(["x", "The history of printing"], [dead, free], use_tqdm=False)
    assert bad.client_error and "no token of this model's vocabulary produces" in (bad.error or "")
    assert good.error is None and good.outputs[0].token_ids == alone


def test_free_requests_unchanged_by_constrained_neighbours(llm: Any) -> None:
    prompts = ["The capital of France is", "List three colors:", "Once upon a time", "def fibonacci(n):"]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=PERSON))
    mixed = llm.generate([p for q in prompts for p in (q, q)], [s for _ in prompts for s in (free, constrained)],
                         use_tqdm=False)
    for a, m in zip(alone, mixed[0::2], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids


def test_preempted_request_resumes_its_grammar(llm_factory: Any) -> None:
    # 24 blocks x 16 = 384 tokens for 8 requests of ~40 prompt + up to 200 tokens: preemptions.
    llm = llm_factory(kv_cache_memory=24 * 16 * 46080, max_model_len=256)
    so = StructuredOutputsParams(json={"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3})
    before = llm.get_metrics()["qpage:num_preemptions_total"]
    outs = llm.chat([CHAT] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=so)
                                 for i in range(8)], use_tqdm=False)
    assert llm.get_metrics()["qpage:num_preemptions_total"] > before
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), so.json)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 6


@pytest.mark.parametrize("so, words", [
    (dict(json={"type": "foo"}), "invalid json: Unsupported type"),
    (dict(regex="a(b"), "invalid regex"),
    (dict(grammar="root ::= missing"), "invalid grammar"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum 5 over maximum 1"),
])
def test_bad_constraints_fail_by_name(llm: Any, so: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kw, words", [
    (dict(), "exactly one of"), (dict(json={}, regex="a"), "got json, regex"), (dict(json="{no"), "not valid JSON"),
    (dict(choice=[]), "non-empty list"), (dict(choice=["a", 3]), "non-empty list"), (dict(regex=""), "non-empty"),
    (dict(json=[1]), "must be a JSON schema"),
])
def test_params_check(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kw)


def test_a_schema_past_the_recursion_limit_is_refused_by_name() -> None:
    """5,000 levels: the depth limit is checked without recursion (no RecursionError)."""
    deep: Any = {}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper than"):
        check_constraint(StructuredOutputsParams(json=deep))
    with pytest.raises(ValueError, match="nests too deeply"):
        StructuredOutputsParams(json="[" * 5000 + "]" * 5000)


def test_choice_grammar_escapes() -> None:
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


class _FixedGuide:
    """A guide whose mask is a given int32 row (what XGrammar's matcher would write)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] | tuple[int, ...] = ()) -> None:
        bitmask[row] = self.words


@pytest.mark.parametrize("vocab", [49152, 1000])  # a vocabulary that is not a multiple of 32 too
def test_token_masks_applied_as_xgrammar_applies_them(vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    words = -(-vocab // 32)
    masks = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    masks[1] &= torch.randint(0, 2, (words,), generator=g, dtype=torch.int32) * -1  # sparse rows as in JSON
    logits = torch.randn(5, vocab, generator=g)
    ours = logits.clone()
    rows, ended = token_masks([_FixedGuide(m) for m in masks], vocab)  # type: ignore[misc]
    assert torch.equal(rows, masks) and not ended
    apply_bitmask(ours, rows, [0, 2, 3])
    ref = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[[0, 2, 3]] = masks
    xgr.apply_token_bitmask_inplace(ref, full)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])  # free rows untouched, bit for bit


def test_guide_masks_and_checks_drafts_without_moving(llm: Any, tokenizer: Any) -> None:
    """A draft's rows are the masks after each draft token in turn, a refused token cuts the
    allowed prefix there, and neither moves the matcher."""
    eng = llm.llm_engine
    guide = Guide(eng.grammars.compile(StructuredOutputsParams(json=PERSON)))
    text = tokenizer.encode('{"name": "Bo", "age": 7}', add_special_tokens=False)
    assert guide.accept(text[0])
    drafts = text[1:6]
    words = -(-eng.arch.vocab_size // 32)
    ours = torch.zeros((1 + len(drafts), words), dtype=torch.int32)
    guide.fill(ours, 0, drafts)
    ref = torch.zeros_like(ours)
    stepped = Guide(eng.grammars.compile(StructuredOutputsParams(json=PERSON)))
    assert stepped.accept(text[0])
    for j in range(len(drafts) + 1):
        stepped.fill(ref, j)
        if j < len(drafts):
            assert stepped.accept(drafts[j])
    assert torch.equal(ours, ref)
    bad = tokenizer.encode("]", add_special_tokens=False)[0]
    assert guide.allowed_prefix([*drafts[:2], bad, drafts[2]]) == 2  # '{"name":' then ']'
    assert guide.allowed_prefix(drafts) == len(drafts)
    again = torch.zeros((1, words), dtype=torch.int32)
    guide.fill(again, 0)
    assert torch.equal(again[0], ours[0])  # still right after the first token
