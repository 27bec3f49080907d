"""A real ``qpage serve`` process on a free loopback port, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
# A small cache (45 blocks = 720 tokens at max_model_len 512) so concurrent long requests
# preempt; 4 running and 8 waiting sequences at most, so the queue bound is reachable and a
# full queue stays partly waiting (not all admitted by the next step) while the test scrapes
# it. Short read timeout and connection bound, so the tests of both finish quickly.
READ_TIMEOUT, MAX_CONNECTIONS = 4, 64
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "32MiB", "--max-num-seqs", "4",
               "--max-waiting", "8", "--api-key", API_KEY, "--log-interval", "1", "--no-access-log",
               "--read-timeout", str(READ_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS)]


@dataclass
class Server:
    url: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: list[str], log: Path, timeout: float = 180.0) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("QPAGE_API_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "qpage.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"qpage serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return Server(url, port, log, proc)
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"qpage serve did not answer /health in {timeout}s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    s = start_server(SERVER_ARGS, tmp_path_factory.mktemp("server") / "serve.log")
    yield s
    stop_server(s)


@pytest.fixture()
def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
