"""The server's grammar compiles: clients take turns, each client's share of the queue is
bounded, a disconnected client's compile leaves the queue or is stopped, a compile past its
time limit is killed (a 400), and the grammar cache keeps resident memory within its bound
however many distinct schemas arrive."""

from __future__ import annotations

import asyncio
import json
import random
import string
import threading
import time
from typing import Any

import pytest

from qpage.engine.grammar_worker import CompileStopped
from qpage.engine.structured import GrammarCompiler
from qpage.sampling_params import StructuredOutputsParams
from qpage.server.compile_queue import MAX_CLIENT_COMPILES, CompileQueue
from qpage.server.protocol import APIError
from tests.server.conftest import MODEL, Server
from tests.server.http import assert_openai_error, raw


class _SlowCompiler:
    """Stands in for GrammarCompiler: each compile takes the seconds its regex names, stops on
    ``cancel``, and is logged in the order it ran."""

    worker = None

    def __init__(self) -> None:
        self.ran: list[str] = []

    def compile(self, spec: StructuredOutputsParams, cancel: threading.Event) -> str:
        self.ran.append(spec.regex or "")
        end = time.monotonic() + float((spec.regex or "0").split(":")[1])
        while time.monotonic() < end:
            if cancel.is_set():
                raise CompileStopped("its request was cancelled")
            time.sleep(0.01)
        return spec.regex or ""


def _spec(name: str, seconds: float) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"{name}:{seconds}")


async def _never() -> bool:
    return False


def test_clients_take_turns_and_each_has_a_bounded_share() -> None:
    async def run() -> tuple[list[str], APIError]:
        fake = _SlowCompiler()
        q = CompileQueue(fake)  # type: ignore[arg-type]
        hog = [asyncio.create_task(q.compile(_spec(f"a{i}", 0.2), "p", "A", _never)) for i in range(2)]
        await asyncio.sleep(0.05)
        polite = asyncio.create_task(q.compile(_spec("b0", 0.01), "p", "B", _never))
        with pytest.raises(APIError) as third:
            await q.compile(_spec("a2", 0.01), "p", "A", _never)
        await asyncio.gather(*hog, polite)
        q.shutdown()
        return fake.ran, third.value
    ran, third = asyncio.run(run())
    assert ran == ["a0:0.2", "b0:0.01", "a1:0.2"]  # B's one compile went before A's second
    assert third.status == 503 and f"already has {MAX_CLIENT_COMPILES}" in third.message


def test_a_disconnected_client_leaves_the_queue_and_its_compile_stops() -> None:
    async def run() -> tuple[list[str], float]:
        fake = _SlowCompiler()
        q = CompileQueue(fake)  # type: ignore[arg-type]
        gone = asyncio.Event()

        async def disconnected() -> bool:
            return gone.is_set()
        running = asyncio.create_task(q.compile(_spec("x", 30), "p", "A", disconnected))
        queued = asyncio.create_task(q.compile(_spec("y", 30), "p", "A", disconnected))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        gone.set()
        for t in (running, queued):
            with pytest.raises(APIError, match="disconnected"):
                await t
        after = await q.compile(_spec("z", 0.01), "p", "B", _never)  # the queue is free again
        q.shutdown()
        return [*fake.ran, after], time.monotonic() - t0
    ran, took = asyncio.run(run())
    assert ran == ["x:30", "z:0.01", "z:0.01"] and took < 5  # y never compiled; x stopped at once


def _enum_schema(rng: random.Random) -> dict[str, Any]:
    words = ["".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(1500)]
    return {"type": "object", "properties": {"e": {"enum": words}}, "required": ["e"]}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_grammar_cache_keeps_resident_memory_within_its_bound(tokenizer: Any) -> None:
    """60 distinct 1,500-value enums (about 1.6 MB compiled each): the process grows by the
    cache's 32 MiB plus at most 32 MiB (XGrammar's own cache grew ~6.6 MB per schema here)."""
    limit = 32 << 20
    grammars = GrammarCompiler(tokenizer, 49152, {2}, cache_bytes=limit)
    rng = random.Random(0)
    grammars.compile(StructuredOutputsParams(json=_enum_schema(rng)))  # the vocabulary, read once
    before = _rss()
    for _ in range(60):
        grammars.compile(StructuredOutputsParams(json=_enum_schema(rng)))
    grown = _rss() - before
    assert grammars.cached_bytes <= limit
    assert grown < limit + (32 << 20), f"resident memory grew {grown >> 20} MiB"


def test_a_compile_past_its_time_limit_is_killed_and_a_400(server: Server) -> None:
    slow = {"type": "string", "pattern": "^([a-z]{1,100}X){1,100}$"}  # minutes to compile
    t0 = time.monotonic()
    status, body = raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                        "guided_json": slow})
    took = time.monotonic() - t0
    assert_openai_error(status, body, 400)
    assert "compile time limit" in body["error"]["message"] and took < 30, (took, body)
    status, body = raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                        "guided_json": {"type": "integer"}})
    assert status == 200 and json.loads(body["choices"][0]["text"]) is not None, body
