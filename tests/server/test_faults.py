"""Bad requests, auth, disconnects, the queue bound and the metrics: each answered the right
way, and the server keeps serving (and keeps no block) afterwards."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.server.conftest import API_KEY, MODEL, Server
from tests.server.http import assert_openai_error, metrics, raw

GOOD = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}


def assert_still_serving(server: Server) -> None:
    status, body = raw(server.url, "/v1/completions", GOOD)
    assert status == 200 and body["choices"][0]["text"], body


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (aborts land between engine steps)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server.url)
        idle = m["qpage:num_requests_running"] == 0 and m["qpage:num_requests_waiting"] == 0
        if (idle and m["qpage:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


BAD_BODIES: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    ("malformed JSON", b'{"model": "x", "prompt": ', 400, None),
    ("not an object", b'[1, 2, 3]', 400, None),
    ("max_tokens wrong type", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature wrong type", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("messages wrong type", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("negative max_tokens", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("temperature below 0", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("top_p above 1", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("n of 0", {**GOOD, "n": 0}, 400, "n"),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt over the context", {**GOOD, "prompt": "word " * 600}, 400, None),
    ("token id out of vocabulary", {**GOOD, "prompt": [1, 2, 10**9]}, 400, None),
    ("unknown model", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("logprobs too many", {**GOOD, "logprobs": 50}, 400, "logprobs"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_request_gets_openai_error(server: Server, name: str, body: Any, status: int, param: str | None) -> None:
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    st, resp = raw(server.url, path, body)
    assert_openai_error(st, resp, status)
    if param is not None:
        assert resp["error"]["param"] == param, resp
    assert_still_serving(server)


def test_ten_megabyte_body_is_413(server: Server) -> None:
    big = json.dumps({**GOOD, "prompt": "a" * (10 * 1024 * 1024)}).encode()
    st, resp = raw(server.url, "/v1/completions", big)
    assert_openai_error(st, resp, 413)
    assert "--max-request-bytes" in resp["error"]["message"]
    assert_still_serving(server)


def test_api_key_required_everywhere_but_health(server: Server) -> None:
    for path, body in (("/v1/completions", GOOD), ("/v1/models", None), ("/metrics", None),
                       ("/tokenize", {"prompt": "hi"}), ("/health?verbose=1", None)):
        for key in (None, "wrong-key"):
            st, resp = raw(server.url, path, body, key=key)
            assert_openai_error(st, resp, 401)
    assert raw(server.url, "/health", key=None)[0] == 200
    st, _ = raw(server.url, "/v1/models", key=None, headers={"Authorization": f"Bearer {API_KEY}"})
    assert st == 200


def test_binds_loopback_by_default(server: Server) -> None:
    assert f"Uvicorn running on http://127.0.0.1:{server.port}" in server.log_text()


def test_disconnect_mid_stream_frees_blocks(client: Any, server: Server) -> None:
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    mid = metrics(server.url)
    assert mid["qpage:num_requests_running"] >= 1 and mid["qpage:kv_cache_usage_perc"] > 0
    stream.close()
    after = wait_idle(server)
    assert after["qpage:kv_cache_usage_perc"] == 0 and after["qpage:num_requests_running"] == 0
    assert_still_serving(server)


@pytest.mark.slow
def test_queue_bound_gives_503_then_recovers(server: Server) -> None:
    import openai

    async def one(c: Any) -> int:
        try:
            await c.completions.create(model=MODEL, prompt="Count: 1 2 3", max_tokens=64, temperature=0,
                                       extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as e:
            body = e.response.json()
            assert set(body["error"]) >= {"message", "type", "param", "code"}
            return e.status_code

    async def burst() -> tuple[list[int], float]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            jobs = asyncio.gather(*(one(c) for _ in range(30)))
            most_waiting = 0.0
            while not jobs.done():  # the waiting gauge, scraped while the burst runs
                m = await asyncio.to_thread(metrics, server.url)
                most_waiting = max(most_waiting, m["qpage:num_requests_waiting"])
                await asyncio.sleep(0.05)
            return await jobs, most_waiting
        finally:
            await c.close()

    codes, most_waiting = asyncio.run(burst())
    assert set(codes) == {200, 503}, codes
    assert codes.count(200) >= 8
    assert most_waiting > 0  # the gauge moved
    wait_idle(server)
    assert_still_serving(server)


@pytest.mark.slow
def test_metrics_parse_and_move(client: Any, server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    before = metrics(server.url)
    # Two long requests at once overflow the 720-token cache: one is preempted.
    async def long_pair() -> None:
        import openai

        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            await asyncio.gather(*(c.completions.create(model=MODEL, prompt="Tell me a story. " * 12 + str(i),
                                                        max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
                                   for i in range(3)))
        finally:
            await c.close()

    asyncio.run(long_pair())
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    after = wait_idle(server)
    _, text = raw(server.url, "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    counters = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                "generation_tokens")
    hists = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
             "request_queue_time_seconds")
    for name in (*gauges, *counters, *hists):
        assert "qpage:" + name in families, name
    for name in counters:
        assert after[f"qpage:{name}_total"] > before[f"qpage:{name}_total"], name
    for name in hists:
        assert after[f"qpage:{name}_count"] > before[f"qpage:{name}_count"], name
    assert families["qpage:time_to_first_token_seconds"].type == "histogram"


@pytest.mark.slow
def test_doctor_command_reads_the_server(server: Server) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "qpage.cli", "doctor", "--url", server.url, "--interval", "0.5", "--json"]
    denied = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert denied.returncode == 2 and "401" in denied.stderr
    ok = subprocess.run([*cmd, "--api-key", API_KEY], capture_output=True, text=True, timeout=60)
    findings = json.loads(ok.stdout)["findings"]
    assert ok.returncode in (0, 1) and findings and all({"check", "status", "evidence"} <= set(f) for f in findings)
    st, body = raw(server.url, "/health?verbose=1")
    assert st == 200 and body["findings"]
