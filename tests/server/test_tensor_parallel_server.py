"""A server over two tensor-parallel ranks: it serves like one process, and when a rank dies
the request in flight and /health answer 503, the server exits non-zero, and no rank is
left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, MODEL, start_server, stop_server
from tests.server.http import raw

pytestmark = pytest.mark.slow

GOOD = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_dead_rank_gives_503_and_the_server_exits(tmp_path: Path, default_model_dir: Path) -> None:
    s = start_server(["--model", str(default_model_dir), "--served-model-name", MODEL, "--tensor-parallel-size", "2",
                      "--distributed-timeout", "10", "--kv-cache-memory", "16MiB", "--api-key", API_KEY,
                      "--no-access-log"], tmp_path / "serve.log")
    try:
        status, body = raw(s.url, "/v1/completions", GOOD)
        assert status == 200 and body["choices"][0]["text"], body
        ranks = [p for p in _children(s.proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert ranks, "the server has a worker process"
        for p in ranks:
            os.kill(p, signal.SIGKILL)
        t = time.monotonic()
        status, body = raw(s.url, "/v1/completions", GOOD)
        assert status == 503, body
        assert "rank 1" in str(body), body
        assert s.proc.wait(timeout=30) == 1, s.log_text()[-2000:]
        print(f"503 and exit {time.monotonic() - t:.2f} s after the rank died")
        assert "the engine stopped" in s.log_text()
        assert all(_gone(p) for p in ranks)
    finally:
        if s.proc.poll() is None:
            stop_server(s)
