"""Structured outputs and tool calls through the official openai client: ten JSON schemas
sampled at temperature 1.0 all parse and validate (jsonschema), regex and choice match,
named and required tool calls carry valid arguments whole and streamed, and every bad
constraint is a 400 naming its field that never reaches the engine."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest

from qpage.server.preprocess import Preprocessor
from qpage.server.protocol import ChatCompletionRequest
from qpage.server.tools import ToolCallReader, template_dicts
from tests.server.conftest import MODEL, Server
from tests.server.http import assert_openai_error, metrics, raw

NAME = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {"type": "object", "required": ["person"], "properties": {"person": {
        "type": "object", "required": ["name", "address"], "properties": {"name": NAME, "address": {
            "type": "object", "required": ["city", "zip"],
            "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array min/max items": {"type": "object", "required": ["scores"], "properties": {"scores": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4}}},
    "enums": {"type": "object", "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}},
    "integer ranges": {"type": "object", "required": ["age", "delta"], "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "delta": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "required and optional": {"type": "object", "required": ["title"], "properties": {
        "title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}}},
    "anyOf": {"type": "object", "required": ["value"], "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 8}, {"type": "boolean"}]}}},
    "array of objects": {"type": "object", "required": ["people"], "properties": {"people": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "required": ["name", "age"],
                                                                  "properties": {"name": NAME, "age": {
                                                                      "type": "integer", "minimum": 0,
                                                                      "maximum": 120}}}}}},
    "booleans and null": {"type": "object", "required": ["ok", "note"], "properties": {
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10}}},
    "top-level array": {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 1,
                        "maxItems": 3},
    "nested arrays": {"type": "object", "required": ["grid"], "properties": {"grid": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
}
WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "required": ["tz"], "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days? Answer in JSON."}]
N, MAX_TOKENS = 3, 300


def _json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client: Any, name: str) -> None:
    schema = SCHEMAS[name]
    r = client.chat.completions.create(model=MODEL, messages=ASK, n=N, temperature=1.0, seed=11,
                                       max_tokens=MAX_TOKENS, response_format=_json_format(schema))
    assert len(r.choices) == N
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_streamed_and_completions_api(client: Any) -> None:
    schema = SCHEMAS["array of objects"]
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=5, stream=True,
                                            max_tokens=MAX_TOKENS, response_format=_json_format(schema))
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model=MODEL, prompt="A JSON list of fruit:", n=N, temperature=1.0, seed=5,
                                  max_tokens=MAX_TOKENS, extra_body={"guided_json": SCHEMAS["top-level array"]})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMAS["top-level array"])
    r = client.completions.create(model=MODEL, prompt="JSON:", n=N, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                                  extra_body={"structured_outputs": {"json_object": True}})
    # Any object is allowed, so a sample may still be inside a long string at max_tokens.
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.text), dict) for c in done)
    assert all(c.finish_reason == "length" for c in r.choices if c not in done)


def test_regex_and_choice(client: Any) -> None:
    pattern = r"[A-Z]{2}-[0-9]{3,4}"
    r = client.chat.completions.create(model=MODEL, messages=ASK, n=N, temperature=1.0, seed=3, max_tokens=20,
                                       extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.message.content) for c in r.choices), [c.message.content for c in r.choices]
    options = ["sunny", "rainy", "partly cloudy"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, n=N, temperature=1.0, seed=3, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": options}})
    assert all(c.message.content in options for c in r.choices)
    stream = client.completions.create(model=MODEL, prompt="Weather:", temperature=1.0, seed=4, max_tokens=20,
                                       stream=True, extra_body={"guided_choice": options})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) in options


def _check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_named_tool_call(client: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, n=N,
                                       temperature=1.0, seed=9, max_tokens=MAX_TOKENS)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0], "get_weather")


def test_named_tool_call_streamed(client: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(N):
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, stream=True)
        deltas, finish = [], None
        for ch in stream:
            assert len({c.index for c in ch.choices}) == len(ch.choices)  # one choice per index per chunk
            for c in ch.choices:
                deltas += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
        assert all(d.index == 0 for d in deltas)
        args = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(args), TIME)


def test_required_tool_calls(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=N,
                                       temperature=1.0, seed=2, max_tokens=MAX_TOKENS)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            _check_call(call)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=2, max_tokens=MAX_TOKENS, stream=True,
                                            parallel_tool_calls=False)
    calls = [d for ch in stream for c in ch.choices for d in c.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0
    _check_call(calls[0])


def test_tool_choice_none_and_auto_without_a_tool_format(client: Any) -> None:
    # SmolLM2's template has no tool-call format: auto and none both give plain content
    for tc in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tc, temperature=0,
                                           max_tokens=12)
        c = r.choices[0]
        assert c.message.tool_calls is None and c.message.content and c.finish_reason == "length"


def test_hermes_tool_calls_are_read_whole_and_streamed() -> None:
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    msg, finish = ToolCallReader("auto", None, hermes=True).message(text, "stop", None)
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]
    reader, sent, finish = ToolCallReader("auto", None, hermes=True), [], None
    for end in range(1, len(text) + 1):  # one character at a time
        delta, finish = reader.feed(text[:end], "stop" if end == len(text) else None, None)
        sent.append(delta)
    content = "".join(d.get("content", "") for d in sent)
    assert content.strip() == "Let me check." and "<" not in content
    calls = [c for d in sent for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert finish == "tool_calls"
    plain, finish = ToolCallReader("auto", None, hermes=True).message("No tools <tool_call>oops</tool_call>", "stop",
                                                                      None)
    assert finish == "stop" and plain["content"] == "No tools <tool_call>oops</tool_call>"


def test_hermes_plain_text_streams_unchanged() -> None:
    reader, text, out = ToolCallReader("auto", None, hermes=True), "Hello world. A < B, and <tool_ x", ""
    for end in range(1, len(text) + 1):
        out += reader.feed(text[:end], "length" if end == len(text) else None, None)[0].get("content", "")
    assert out == text
    assert ToolCallReader("auto", None, hermes=True).message(" spaced \n", "stop", None)[0]["content"] == " spaced \n"


def test_a_cut_call_is_not_a_finished_call() -> None:
    named = ToolCallReader("named", "get_time", hermes=False)
    msg, finish = named.message('{"tz": "C', "stop", "C")  # a stop string, not the grammar, ended it
    assert finish == "stop" and msg["tool_calls"][0]["function"]["arguments"] == '{"tz": "C'
    assert named.message('{"tz": "CET"}', "stop", None)[1] == "tool_calls"
    required = ToolCallReader("required", None, hermes=False)
    msg, finish = required.message('[{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_w', "length",
                                   None)
    assert finish == "length" and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    msg, finish = required.message('[{"name": "get', "length", None)
    assert finish == "length" and "tool_calls" not in msg and msg["content"] == '[{"name": "get'


def test_required_with_shared_defs(client: Any) -> None:
    point = {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}}
    params = {"type": "object", "required": ["at"], "properties": {"at": {"$ref": "#/$defs/Point"}},
              "$defs": {"Point": point}}
    tools = [{"type": "function", "function": {"name": "move", "parameters": params}}]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required", temperature=1.0,
                                       seed=1, max_tokens=MAX_TOKENS)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), params)


TREE = {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 9},
    "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}}}
OLD_DEFS = {"type": "object", "required": ["p"], "properties": {"p": {"$ref": "#/definitions/P"}},
            "definitions": {"P": {"enum": ["north", "south"]}}}


def test_required_resolves_refs_within_each_tool(client: Any) -> None:
    """``#`` is the tool's own schema and ``definitions`` work, as in named mode: each tool's
    schema sits under the array of calls with its references rebased."""
    tools = [{"type": "function", "function": {"name": "plant", "parameters": TREE}},
             {"type": "function", "function": {"name": "face", "parameters": OLD_DEFS}}]
    schemas = {"plant": TREE, "face": OLD_DEFS}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


DEEP: dict[str, Any] = {"type": "integer"}
for _ in range(40):  # past the engine's schema depth limit
    DEEP = {"type": "array", "items": DEEP}
VERY_DEEP: Any = {}
for _ in range(450):  # 900 levels of JSON: the body parses, a recursive walk of it would not
    VERY_DEEP = {"type": "array", "items": VERY_DEEP}
NESTED_TEXT = "[" * 3000 + "]" * 3000  # JSON text past Python's recursion limit
CALLED = [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
    "name": "get_time", "arguments": NESTED_TEXT}}]}, {"role": "tool", "content": "noon", "tool_call_id": "c1"}]
BAD = [
    ("response_format", {"response_format": _json_format({"type": "nonsense"})}),
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("response_format", {"response_format": {"type": "yaml"}}),
    ("guided_json", {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}),
    ("guided_json", {"guided_json": "{not json"}),
    ("guided_regex", {"guided_regex": "a(b"}),
    ("guided_choice", {"guided_choice": []}),
    ("guided_grammar", {"guided_grammar": "root ::= undefined_rule"}),
    ("structured_outputs", {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}),
    ("structured_outputs", {"structured_outputs": {"colour": "red"}}),
    ("guided_json", {"guided_json": {"type": "object"}, "guided_regex": "a"}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
               "tool_choice": "required"}),
    ("response_format", {"tools": TOOLS, "tool_choice": "required",
                         "response_format": {"type": "json_object"}}),
    ("guided_regex", {"guided_regex": "[a-z]{1,5000}"}),
    ("guided_json", {"guided_json": {"type": "string", "pattern": "^x{2000}$"}}),
    ("guided_json", {"guided_json": DEEP}),
    ("guided_json", {"guided_json": VERY_DEEP}),
    ("guided_json", {"guided_json": NESTED_TEXT}),
    ("structured_outputs", {"structured_outputs": {"json": VERY_DEEP}}),
    ("messages", {"messages": CALLED}),
    ("structured_outputs", {"structured_outputs": {"json_object": 1}}),
    ("guided_json", {"guided_json": {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}}),
    ("guided_json", {"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
    ("response_format", {"response_format": _json_format({"type": "integer", "enum": ["a", "b"]})}),
    ("guided_regex", {"guided_regex": "a^b"}),
    ("guided_regex", {"guided_regex": r"[^\s\S]"}),
    ("guided_grammar", {"guided_grammar": 'root ::= a\na ::= a "x"'}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": [1, 2]}}}], "tool_choice": "required"}),
]


@pytest.mark.parametrize("field, extra", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(server: Server, field: str, extra: dict[str, Any]) -> None:
    before = metrics(server.url)["qpage:prompt_tokens_total"]
    status, body = raw(server.url, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 5,
                                                             **extra})
    assert_openai_error(status, body, 400)
    assert body["error"]["param"] == field, body
    assert metrics(server.url)["qpage:prompt_tokens_total"] == before  # it never reached the engine
    status, body = raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 200, body


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_receives_tools_and_tool_messages(llm: Any) -> None:
    engine = llm.llm_engine
    pre = Preprocessor(engine.tokenizer, engine.max_model_len, engine.arch.vocab_size, HERMES_TEMPLATE)
    body = ChatCompletionRequest(model=MODEL, tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}])
    text = asyncio.run(pre.render_chat([m.as_template_dict() for m in body.messages], True, False,
                                       template_dicts(body)))
    pre.shutdown()
    assert text.startswith("<tools>get_weather:") and '"maximum": 7' in text and "get_time:" in text
    assert '<tool_call>get_weather{"city": "Paris", "days": 3}</tool_call>' in text  # arguments as a mapping
    assert "<|tool|>sunny[call_1]" in text and pre.hermes_tools


@pytest.mark.parametrize("grammar, code", [
    ('root ::= s\ns ::= s s | "a" | "b" | "c"', None),  # refused by the compile-time walk
    ('root ::= [0-9]{80} s\ns ::= s s | "a" | "b" | "c"', "request_too_costly"),  # ended by the step budget
])
def test_a_grammar_too_costly_to_follow_is_a_400(server: Server, grammar: str, code: str | None) -> None:
    body = {"model": MODEL, "prompt": "x", "guided_grammar": grammar, "max_tokens": 400, "temperature": 1,
            "seed": 1, "n": 4}
    status, reply = raw(server.url, "/v1/completions", body)
    assert_openai_error(status, reply, 400)
    assert "too ambiguous" in reply["error"]["message"] and reply["error"]["code"] == code
    status, reply = raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 200, reply
