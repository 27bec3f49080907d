"""The qpage command line, run as a user would (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def qpage(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qpage.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_generate_prints_text() -> None:
    r = qpage("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8",
              "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "KV cache" in r.stdout and "tokens" in r.stdout  # capacity printed at start


@pytest.mark.slow
def test_chat_streams_a_reply_and_exits() -> None:
    r = qpage("chat", "--temperature", "0", "--max-tokens", "20", "--kv-cache-memory", "64MiB",
              stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow
def test_cli_errors_are_clear() -> None:
    r = qpage("generate", "hi", "--model", "/no/such/dir")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = qpage("generate", "hi", "--temperature", "-1", "--kv-cache-memory", "64MiB")
    assert r.returncode == 2 and "temperature=-1.0 is invalid" in r.stderr


def test_cli_defaults_come_from_the_dataclasses() -> None:
    from qpage.cli import _parser
    from qpage.config import CacheConfig, SchedulerConfig
    from qpage.sampling_params import SamplingParams

    args = _parser().parse_args(["generate", "x"])
    assert args.max_tokens == SamplingParams().max_tokens
    assert args.temperature == SamplingParams().temperature
    assert args.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert args.kv_cache_memory == CacheConfig.__dataclass_fields__["kv_cache_memory"].default


@pytest.mark.slow
def test_quantize_and_inspect_commands(tmp_path: Path) -> None:
    out = tmp_path / "q4"
    r = subprocess.run([sys.executable, "-m", "qpage.cli", "quantize", "default", str(out), "--scheme", "int4-rtn",
                        "--group-size", "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "int4 rtn g64 sym (gptq format), 210 linears" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qpage.cli", "inspect", str(out)], capture_output=True, text=True,
                       timeout=300)
    info = json.loads(r.stdout)
    assert info["bits"] == 4 and info["group_size"] == 64 and info["bits_per_weight"] == 4.25
    r = subprocess.run([sys.executable, "-m", "qpage.cli", "quantize", "default", str(out), "--scheme", "int4-rtn"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "already exists; choose a new output folder" in r.stderr
