"""The server as an attacker or a careless client uses it: one request's failure stays its
own, admission counts sequences, the key is checked before any body byte is read, slow
clients are cut off, text that cannot be encoded is a 400, and a connection survives an
error."""

from __future__ import annotations

import http.client
import itertools
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.server.conftest import API_KEY, MAX_CONNECTIONS, MODEL, READ_TIMEOUT, Server
from tests.server.http import assert_openai_error, call, raw
from tests.server.test_faults import GOOD, assert_still_serving, wait_idle

LONG = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


def stream_text(client: Any, max_tokens: int = 24, prompt: str = "The history of the printing press") -> tuple:
    """A greedy stream's (text, finish_reason); raises if the stream carries an error event."""
    text, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            text.append(c.text)
            finish = c.finish_reason or finish
    return "".join(text), finish


def open_socket(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT + 5)


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body), without waiting for the close."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536) or b"<closed>"
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536) or b"<closed>"
    return out


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (socket.timeout if it never does)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


# ---------------------------------------------------------------- one request's values cannot fail others
# (the in-step isolation itself is tested on the engine: tests/engine/test_request_isolation.py)
def test_huge_top_k_does_not_end_other_streams(client: Any, server: Server) -> None:
    alone = stream_text(client)
    with ThreadPoolExecutor(2) as ex:
        innocents = [ex.submit(stream_text, client) for _ in range(2)]
        time.sleep(0.5)
        st, body = raw(server.url, "/v1/completions", {**GOOD, "top_k": 2**63, "top_p": 0.9, "temperature": 1.0})
        results = [f.result() for f in innocents]
    assert st == 200 and body["choices"][0]["text"], body  # a top_k past the vocabulary keeps it all
    assert results == [alone, alone]
    assert wait_idle(server)["qpage:kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------- admission counts sequences
def test_n_over_max_n_is_400(server: Server) -> None:
    st, _, body = call(server.url, "/v1/completions", {**GOOD, "n": 17})
    assert_openai_error(st, body, 400)
    assert body["error"]["param"] == "n" and "--max-n" in body["error"]["message"]


def test_request_larger_than_the_queue_is_400_not_503(server: Server) -> None:
    for extra, param in (({"n": 9}, "n"), ({"prompt": ["Hello"] * 9}, "prompt")):
        st, _, body = call(server.url, "/v1/completions", {**GOOD, **extra})
        assert_openai_error(st, body, 400)
        assert body["error"]["param"] == param and "--max-waiting 8" in body["error"]["message"]
    assert_still_serving(server)


def test_queue_bound_counts_sequences_and_503_says_retry_after(client: Any, server: Server) -> None:
    # n=8 on a server running 4 sequences at most: 4 run and 4 wait while it streams.
    stream = client.completions.create(stream=True, n=8, **{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        st, headers, body = call(server.url, "/v1/completions", {**GOOD, "n": 5})  # 4 + 5 > 8
        assert_openai_error(st, body, 503)
        assert body["error"]["code"] == "server_busy" and int(headers["retry-after"]) >= 1
    finally:
        stream.close()
    wait_idle(server)
    assert_still_serving(server)


# ---------------------------------------------------------------- auth, timeouts, connections
def test_key_is_checked_before_the_body_is_read(server: Server) -> None:
    with open_socket(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 4000000\r\n\r\n")  # no key, and the body never comes
        t0 = time.monotonic()
        reply = read_response(s)
        assert time.monotonic() - t0 < READ_TIMEOUT  # answered at once, not after a timeout
        assert reply.startswith(b"HTTP/1.1 401"), reply[:300]
        s.sendall(b"x" * 100_000)  # body bytes that follow are dropped, and the connection ends
        assert read_all(s) == b""
    assert time.monotonic() - t0 < 2 * READ_TIMEOUT + 3


def test_slow_head_is_cut_off(server: Server) -> None:
    with open_socket(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        t0 = time.monotonic()
        assert read_all(s) == b""
    assert time.monotonic() - t0 < READ_TIMEOUT + 3


def test_slow_body_gets_408(server: Server) -> None:
    with open_socket(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b"--read-timeout" in reply, reply[:300]


def test_connections_past_the_bound_get_503(server: Server) -> None:
    idle = [open_socket(server) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline, st = time.monotonic() + READ_TIMEOUT / 2, 0
        while st != 503 and time.monotonic() < deadline:  # until the server has accepted them all
            st = call(server.url, "/v1/models")[0]
            time.sleep(0.1)
        assert st == 503
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert_still_serving(server)


def test_encoded_query_cannot_skip_the_key(server: Server) -> None:
    for path in ("/health?%76erbose=1", "/health?verbose", "/health?x=1&verbose=0"):
        st, _, body = call(server.url, path, key=None)
        assert_openai_error(st, body, 401)
    assert call(server.url, "/health", key=None)[0] == 200
    assert call(server.url, "/health", key=None, method="HEAD")[0] == 200
    assert call(server.url, "/v1/models", key=None, headers={"X-API-Key": API_KEY})[0] == 200


# ---------------------------------------------------------------- bad text, bad numbers
SURROGATE = "a\ud800b"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**GOOD, "prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["fine", SURROGATE]}, "prompt"),
    ("/v1/completions", {**GOOD, "stop": [SURROGATE]}, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
])
def test_lone_surrogate_is_400_and_connection_survives(server: Server, path: str, body: dict, param: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        st, _, resp = call(server.url, path, body, conn=conn)
        assert_openai_error(st, resp, 400)
        assert resp["error"]["param"].startswith(param), resp
        assert "UTF-8" in resp["error"]["message"]
        st, _, resp = call(server.url, "/v1/completions", GOOD, conn=conn)  # the same pooled connection
        assert st == 200, resp
    finally:
        conn.close()
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", float("nan")), ("temperature", float("inf")), ("repetition_penalty", float("nan")),
    ("top_p", float("nan")), ("presence_penalty", float("-inf")), ("max_tokens", True), ("temperature", True),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("prompt_logprobs", 1),
])
def test_bad_number_is_400_naming_the_field(server: Server, field: str, value: Any) -> None:
    st, _, body = call(server.url, "/v1/completions", {**GOOD, field: value})
    assert_openai_error(st, body, 400)
    assert body["error"]["param"] == field, body


def test_seeds_equal_modulo_2_32_differ(server: Server) -> None:
    def sample(seed: int) -> str:
        body = {**GOOD, "prompt": "Random words:", "max_tokens": 16, "temperature": 2.0, "seed": seed}
        st, _, resp = call(server.url, "/v1/completions", body)
        assert st == 200, resp
        return resp["choices"][0]["text"]

    assert sample(11) == sample(11)
    assert sample(11) != sample(11 + 2**32)


def test_max_tokens_past_the_context_is_400(server: Server) -> None:
    st, _, body = call(server.url, "/v1/completions", {**GOOD, "max_tokens": 10**9})
    assert_openai_error(st, body, 400)
    assert body["error"]["param"] == "max_tokens" and "ask for at most" in body["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 600}
    assert call(server.url, "/v1/chat/completions", chat)[0] == 400
    # Left out, it fills the context.
    st, _, body = call(server.url, "/v1/completions", {**GOOD, "prompt": "word " * 480, "max_tokens": None})
    assert st == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def test_compressed_or_non_utf8_body_is_named(server: Server) -> None:
    st, _, body = call(server.url, "/v1/completions", b"\x1f\x8b\x08\x00", headers={"Content-Encoding": "gzip"})
    assert_openai_error(st, body, 415)
    assert "gzip" in body["error"]["message"]
    st, _, body = call(server.url, "/v1/completions", b'{"prompt": "caf\xe9"}')
    assert_openai_error(st, body, 400)
    assert "not valid UTF-8" in body["error"]["message"]
    st, _, body = call(server.url, "/v1/completions", b"[" * 100_000)
    assert_openai_error(st, body, 400)
    assert "could not be parsed as JSON" in body["error"]["message"]
    assert_still_serving(server)


# ---------------------------------------------------------------- tokenization off the step loop
@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_large_tokenization_does_not_stall_decoding(client: Any, server: Server, path: str) -> None:
    """While a 3.9 MB text is tokenized (then counted, or refused as too long), a running
    stream keeps its pace: no gap between its chunks near the tokenization's duration."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "omicron"]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(400_000))[:3_900_000]
    body = {"prompt": text} if path == "/tokenize" else {**GOOD, "prompt": text}
    arrivals: list[float] = []

    def consume() -> None:
        for _ in client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            arrivals.append(time.monotonic())

    with ThreadPoolExecutor(1) as ex:
        job = ex.submit(consume)
        while len(arrivals) < 5:
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        t0 = time.monotonic()
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                   "Authorization": f"Bearer {API_KEY}"})
        reply = conn.getresponse()
        raw_body = reply.read()
        t1 = time.monotonic()  # the reply is parsed after the window: that parse holds the GIL
        conn.close()
        job.result()
    assert reply.status == (200 if path == "/tokenize" else 400), raw_body[:300]
    assert json.loads(raw_body)
    during = [b - a for a, b in itertools.pairwise(arrivals) if b > t0 and a < t1]
    assert t1 - t0 > 0.5 and during, (t1 - t0, len(during))
    assert max(during) < 0.5 * (t1 - t0), (max(during), t1 - t0)
