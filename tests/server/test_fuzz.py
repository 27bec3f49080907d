"""Fuzzing the completions and chat endpoints (hypothesis, bounded and derandomized): random
bodies and field values (extreme numbers, NaN and infinities, wrong types, odd Unicode,
huge lists, broken JSON) sent while two innocent greedy streams run. No response is ever
a 5xx, the innocent streams always finish with the text they give alone, and no KV block
is held afterwards. Then fuzzed constraints in every field that takes one: each is refused
by name or each finished output is valid."""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qpage.engine.schema_check import UNSUPPORTED
from tests.constraint_strategies import SOMETIMES_UNSUPPORTED, TREES, render
from tests.server.conftest import API_KEY, MODEL, Server, start_server, stop_server
from tests.server.http import raw
from tests.server.test_faults import wait_idle

pytestmark = pytest.mark.slow
CLIENT_TIMEOUT = 4.0  # a fuzz request still running after this is dropped (the server aborts it)
INNOCENT = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True}
SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]
ODD_TEXT = st.one_of(
    st.text(max_size=40), st.sampled_from([*SURROGATES, "", "\x00", "\u202e\u0301", "\U0010ffff", "é" * 500]),
    st.text(st.characters(codec="utf-8"), max_size=200),
)
NUMBERS = st.one_of(
    st.sampled_from([0, 1, 2, -1, 16, 17, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e-300, 1e308,
                     float("nan"), float("inf"), float("-inf")]),
    st.integers(), st.floats(), st.integers(1, 8),
)
ANY_VALUE = st.one_of(NUMBERS, ODD_TEXT, st.booleans(), st.none(), st.just([]), st.just({}),
                      st.lists(st.integers(-5, 60000), max_size=5))
SMALL = st.integers(1, 6)  # valid max_tokens and n
VALID = {  # in-range values, so that part of the fuzzed requests run
    "max_tokens": SMALL, "n": SMALL, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 2**70), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3), "min_tokens": st.integers(0, 4),
    "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=8), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=4), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "ignore_eos": st.booleans(), "logprobs": st.integers(0, 20),
    "model": st.just(MODEL), "skip_special_tokens": st.booleans(), "user": st.text(max_size=10),
    "max_completion_tokens": SMALL, "top_logprobs": st.integers(0, 20), "continue_final_message": st.just(False),
    "guided_choice": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=6), min_size=1, max_size=3),
    "guided_regex": st.sampled_from(["[a-z]{1,5}", "yes|no", "a(b", "[0-9]+"]),
    "guided_json": st.sampled_from([{"type": "object"}, {"type": "foo"}, {"type": "array", "maxItems": 2}]),
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"json_object": True}, {"regex": "x"}, {}]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": "g"}}]),
}
WILD = {
    "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=20), ANY_VALUE),
    "stop_token_ids": st.one_of(st.lists(NUMBERS, max_size=5), ANY_VALUE),
}
COMPLETION_FIELDS = ["max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "stream",
                     "stream_options", "ignore_eos", "logprobs", "model", "skip_special_tokens", "user",
                     "prompt_logprobs", "echo", "best_of", "guided_choice", "guided_regex", "guided_json",
                     "structured_outputs", "response_format"]
CHAT_FIELDS = [*(f for f in COMPLETION_FIELDS if f not in ("logprobs", "echo", "best_of")),
               "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "continue_final_message"]
PROMPTS = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=60), ODD_TEXT, st.lists(ODD_TEXT, max_size=4),
    st.lists(st.integers(-3, 70000), max_size=8),
    st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), max_size=3),
    st.sampled_from([["x"] * 100, ["x"] * 5000, [7] * 100_000, "word " * 2000, [[1]] * 500]), ANY_VALUE,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard", 5])},
    optional={"content": st.one_of(ODD_TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", 3])}, optional={"text": ODD_TEXT}), max_size=3), ANY_VALUE)},
)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4),
                     st.just([{"role": "user", "content": "Name a color."}]),
                     st.just([{"role": "user", "content": "hi"}] * 3000),
                     ANY_VALUE)
RAW_BODIES = st.sampled_from([b"", b"{", b"[1, 2]", b"null", b'{"prompt": "caf\xe9"}', b"\xff\xfe{}",
                              b"[" * 100_000, b'{"prompt": "' + b"a" * 5_000_000 + b'"}'])


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """(path, body bytes, extra headers) for one fuzz request."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    headers = draw(st.sampled_from([{}] * 8 + [{"Content-Encoding": "gzip"}, {"Content-Type": "text/plain"}]))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(RAW_BODIES), {}
    chat = path.endswith("chat/completions")
    names = draw(st.lists(st.sampled_from(CHAT_FIELDS if chat else COMPLETION_FIELDS), max_size=6, unique=True))
    body: dict[str, Any] = {"model": MODEL}
    body["messages" if chat else "prompt"] = draw(MESSAGES if chat else PROMPTS)
    for name in names:
        wild = WILD.get(name, ANY_VALUE)
        body[name] = draw(st.one_of(VALID[name], wild) if name in VALID else wild)
    return path, json.dumps(body).encode(), headers  # NaN/Infinity literals, surrogates as \u escapes


def send(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str]:
    """(status, body) of one request; status None when it outlived CLIENT_TIMEOUT (then dropped)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {API_KEY}", **headers})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    except TimeoutError:
        return None, ""
    except (ConnectionError, http.client.HTTPException) as e:
        return -1, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def innocent_text(port: int) -> str:
    """The innocent stream's text; raises on any error event or status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(INNOCENT),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        r = conn.getresponse()
        raw = r.read().decode()
    finally:
        conn.close()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    if r.status != 200 or not events or events[-1] != "[DONE]":
        raise AssertionError(f"innocent stream: status {r.status}, body {raw[-500:]}")
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    args = ["--max-model-len", "512", "--kv-cache-memory", "32MiB", "--max-num-seqs", "8", "--max-waiting", "80",
            "--api-key", API_KEY, "--read-timeout", "5", "--log-interval", "5", "--no-access-log"]
    s = start_server(args, tmp_path_factory.mktemp("fuzz") / "serve.log")
    yield s
    stop_server(s)


def test_fuzzed_requests_never_5xx_and_spare_innocent_streams(fuzz_server: Server) -> None:
    port = fuzz_server.port
    alone = innocent_text(port)
    stop, problems, rounds = threading.Event(), [], [0]

    def innocents() -> None:  # two greedy streams at a time, for as long as the fuzzing lasts
        with ThreadPoolExecutor(2) as ex:
            while not stop.is_set():
                try:
                    texts = list(ex.map(lambda _: innocent_text(port), range(2)))
                except Exception as e:
                    problems.append(repr(e))
                    return
                problems.extend(f"innocent got {t!r}, alone {alone!r}" for t in texts if t != alone)
                rounds[0] += 1

    runner = threading.Thread(target=innocents, daemon=True)
    runner.start()
    seen: dict[int | None, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=requests())
    def one(case: tuple[str, bytes, dict[str, str]]) -> None:
        status, text = send(port, *case)
        seen[status] = seen.get(status, 0) + 1
        assert status is None or 200 <= status < 500, (case[0], case[1][:300], status, text[:500])
        assert '"server_error"' not in text, (case[0], case[1][:300], text[:500])

    try:
        one()
    finally:
        stop.set()
        runner.join(timeout=120)
    assert not problems, problems[:3]
    print(f"fuzz statuses {seen}, innocent rounds {rounds[0]}")
    assert rounds[0] >= 2 and seen.get(200, 0) >= 5 and seen.get(400, 0) >= 20, (rounds, seen)
    after = wait_idle(fuzz_server, timeout=60)
    assert after["qpage:kv_cache_usage_perc"] == 0 and after["qpage:num_requests_running"] == 0
    assert "Traceback" not in fuzz_server.log_text()


Check = Callable[[str], None]


def _json_check(schema: dict[str, Any]) -> Check:
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    return check


def _regex_check(rx: str) -> Check:
    def check(text: str) -> None:
        assert re.fullmatch(rx, text), (rx, text)
    return check


def _object_check(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


@st.composite
def constrained(draw: st.DrawFn) -> tuple[str, dict[str, Any], Check, dict[str, Any] | None]:
    """(path, body, check of a finished output, the schema when the constraint is one) for a
    request in one of the API's constraint fields, or a chat tool call with a fuzzed schema."""
    form = draw(st.sampled_from(["guided_json", "response_format", "structured_outputs", "json_object",
                                 "guided_regex", "guided_grammar", "guided_choice", "tool"]))
    chat = form == "tool" or draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 1.0, "n": draw(st.integers(1, 2)),
                            "seed": draw(st.integers(0, 1000))}
    if chat:
        body["messages"] = [{"role": "user", "content": "Reply with a short JSON value."}]
    else:
        body["prompt"] = "A short JSON value:"
    schema = draw(SOMETIMES_UNSUPPORTED) if form in ("guided_json", "response_format", "structured_outputs",
                                                     "tool") else None
    tree = draw(TREES)
    check: Check = _json_check(schema) if schema is not None else _regex_check(render(tree, "regex"))
    if form == "guided_json":
        body["guided_json"] = schema
    elif form == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    elif form == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    elif form == "json_object":
        body["response_format"], check = {"type": "json_object"}, _object_check
    elif form == "guided_regex":
        body["guided_regex"] = render(tree, "regex")
    elif form == "guided_grammar":
        body["guided_grammar"] = f"root ::= {render(tree, 'ebnf')}"
    elif form == "guided_choice":
        choices = draw(st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=6), min_size=1,
                                max_size=3))
        body["guided_choice"], check = choices, _regex_check("|".join(map(re.escape, choices)))
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = draw(st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, check, schema


def _outputs(path: str, reply: dict[str, Any]) -> list[tuple[str, str]]:
    """(finish_reason, text to check) of each finished output: the text, the message's
    content, or each tool call's arguments."""
    outs = []
    for c in reply["choices"]:
        if path == "/v1/completions":
            outs.append((c["finish_reason"], c["text"]))
        elif c["message"].get("tool_calls"):
            outs += [(c["finish_reason"], call["function"]["arguments"]) for call in c["message"]["tool_calls"]]
        else:
            outs.append((c["finish_reason"], c["message"]["content"]))
    return outs


def test_fuzzed_constraints_refused_by_name_or_every_finished_output_valid(fuzz_server: Server) -> None:
    """Random schemas (in guided_json, response_format, structured_outputs and tool
    parameters), regexes, grammars and choices over HTTP: a schema with a keyword the grammar
    cannot enforce is a 400 naming it; every output that ends as its constraint ends
    ("stop", or "tool_calls") is valid (``jsonschema`` with its format checker, or
    ``re.fullmatch`` for regexes, grammars and choices)."""
    counts = {"valid": 0, "refused": 0, "cut": 0}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=constrained())
    def one(case: tuple[str, dict[str, Any], Check, dict[str, Any] | None]) -> None:
        path, body, check, schema = case
        status, reply = raw(fuzz_server.url, path, body)
        unsupported = [k for k in UNSUPPORTED if schema is not None and k in schema]
        if status == 400:
            assert isinstance(reply, dict) and "error" in reply, reply
            message = reply["error"]["message"]
            assert not unsupported or any(f"`{k}`" in message for k in unsupported), (body, message)
            counts["refused"] += 1
            return
        assert status == 200 and not unsupported, (status, body, reply)
        for finish, text in _outputs(path, reply):
            if finish in ("stop", "tool_calls"):
                check(text)
                counts["valid"] += 1
            else:
                counts["cut"] += 1

    one()
    print(f"fuzzed constraints: {counts}")
    assert counts["valid"] >= 10 and counts["refused"] >= 1, counts
