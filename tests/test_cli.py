"""The qpage command line, run as a user would (a real subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    spec = qpage("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8",
                 "--kv-cache-memory", "64MiB", "--speculative-config", ngram)
    assert spec.returncode == 0, spec.stderr
    first, _, text = spec.stdout.partition("\n")
    assert "speculative decoding: ngram, up to 3 tokens" in first  # the start line says so
    assert text == r.stdout.partition("\n")[2]  # speculation changes no greedy token


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
    r = qpage("generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    assert r.returncode == 2 and "num_speculative_tokens=0 must be an integer from 1 to 32" in r.stderr


def test_cli_defaults_come_from_the_dataclasses() -> None:
    from qpage.cli import _parser
    from qpage.config import CacheConfig, SchedulerConfig
    from qpage.sampling_params import SamplingParams

    args = _parser().parse_args(["generate", "x"])
    assert args.max_tokens is None  # the CLI runs to EOS; SamplingParams keeps vLLM's 16
    assert _parser().parse_args(["chat"]).max_tokens is None
    assert args.repetition_penalty == 1.1 and SamplingParams().repetition_penalty == 1.0
    assert args.temperature == SamplingParams().temperature
    assert args.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert args.kv_cache_memory == CacheConfig.__dataclass_fields__["kv_cache_memory"].default


@pytest.mark.slow
def test_generate_chat_runs_to_eos_by_default() -> None:
    r = qpage("generate", "--chat", "Name the three primary colors and say why they are called primary.",
              "--temperature", "0", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("(stop)"), r.stdout[-500:]
    tokens = int(r.stderr.split(" tokens in ")[0].rsplit(" ", 1)[1])
    assert tokens > 16, r.stderr  # past SamplingParams' default, ended by EOS


@pytest.mark.slow
def test_chat_answers_whole_and_ctrl_c_stops_only_the_answer(tokenizer: Any) -> None:
    import signal

    # Bytes read straight from the pipe: communicate() reads the fd, so nothing may sit in a
    # Python-side buffer in between.
    proc = subprocess.Popen([sys.executable, "-m", "qpage.cli", "chat", "--temperature", "0", "--kv-cache-memory",
                             "64MiB"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"Tell me a story about a dragon.\n")
        proc.stdin.flush()
        first = b""  # the start line, then the first answer streaming
        while b"\n> " not in first or len(first.split(b"\n> ", 1)[1]) < 20:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            first += chunk
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"Name the three primary colors and say why they are called primary.\n/exit\n")
        proc.stdin.flush()
        out, err_bytes = proc.communicate(timeout=300)
    finally:
        proc.kill()
    err = err_bytes.decode()
    assert proc.returncode == 0, err
    assert "(stopped)" in err and "(cut:" not in err, err  # one answer stopped, the next one whole
    start, *answers = (first + out).decode().split("\n> ")  # "qpage: ...\n> story\n> colors\n> " (/exit's prompt)
    assert start.startswith("qpage: ") and len(answers) == 3 and answers[-1] == "", answers
    assert len(answers[0]) >= 20, "the first answer was streaming when Ctrl-C stopped it"
    # The second answer is about colors, whole (past 16 tokens). Its wording depends on where the
    # first answer was stopped, which the machine's speed decides: "primary" is not always in it.
    assert "colo" in answers[1].lower() and len(tokenizer.encode(answers[1])) > 16, answers[1]
    cut = qpage("chat", "--temperature", "0", "--max-tokens", "3", "--kv-cache-memory", "64MiB",
                stdin="Tell me a story about a dragon.\n/exit\n")
    assert cut.returncode == 0 and "(cut: --max-tokens" in cut.stderr, cut.stderr


def test_version_reports_the_machine() -> None:
    import torch

    from qpage import __version__
    from qpage.layers.attention.kv_format import KVCacheSpec
    from qpage.layers.attention.selector import select_attention_backend

    r = qpage("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"qpage {__version__}\n") and f"torch {torch.__version__}" in r.stdout
    attn = select_attention_backend(torch.device("cpu"), KVCacheSpec.from_config("auto", "auto", torch.float32), 64)
    assert f"paths on cpu with float32: attention {attn.name};" in r.stdout
    assert "C kernels (cpu-native): " in r.stdout and "cuda: " in r.stdout and "triton: " in r.stdout
    assert qpage("version").stdout == r.stdout


@pytest.mark.slow
def test_inspect_default_gguf(hf_model: Any) -> None:
    from qpage.formats.gguf import default_gguf_path

    r = qpage("inspect", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    n_params = sum(p.numel() for p in hf_model.parameters())  # tied head counted once
    size = default_gguf_path().stat().st_size
    assert info["format"] == "gguf" and info["scheme"] == "Q4_1" and info["size_bytes"] == size
    assert 0.95 * size <= info["bits_per_weight"] * n_params / 8 <= size  # tensor bytes within the file
    assert {t["type"] for t in info["tensors"]} == {"Q4_1", "Q8_0", "F32"}
    assert sum(t["type"] == "Q4_1" for t in info["tensors"]) == info["tensor_types"]["Q4_1"] == 210
    loaded = info["loaded"]
    # Loaded natively: the weights stay in their blocks (the fp32 copy would be 4 bytes a weight).
    assert loaded["dtype"] == "float32" and loaded["memory_bytes"] <= 1.05 * info["tensor_bytes"]
    # qkv, o, gate_up and down per decoder layer (q/k/v and gate/up fused), and the embedding
    # whose table the tied head multiplies with, all on the block-format kernels
    assert loaded["linear_paths"] == {"cpu-blocks": {"layers": 4 * info["layers"] + 1,
                                                   "bytes": loaded["linear_paths"]["cpu-blocks"]["bytes"]}}
    table = qpage("inspect").stdout
    assert "Q4_1" in table and "bits per weight" in table and "in memory (cpu, float32)" in table, table


@pytest.mark.slow
def test_quantize_and_inspect_commands(tmp_path: Path) -> None:
    out = tmp_path / "q4"
    r = subprocess.run([sys.executable, "-m", "qpage.cli", "quantize", "default", str(out), "--scheme", "int4-rtn",
                        "--group-size", "64", "--eval-text", "python-docs", "--eval-windows", "1", "--seq-len", "128"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "int4 rtn g64 asym (gptq format), 210 linears" in r.stdout  # 4 bits: a zero point by default
    assert re.search(r"perplexity on 1 x 128 tokens of python-docs: source [\d.]+, quantized [\d.]+ \(\+", r.stdout), \
        r.stdout
    info = json.loads(qpage("inspect", str(out), "--json", "--dtype", "bfloat16").stdout)
    assert info["bits"] == 4 and info["group_size"] == 64 and info["bits_per_weight"] == 4 + 20 / 64
    assert info["scheme"] == "int4 g64 asym" and info["format"].startswith("gptq")
    (q,) = info["quality"]
    assert q["text"] == "python-docs" and q["perplexity"] > q["source_perplexity"] > 1 and q["mean_kl"] > 0
    paths = info["loaded"]["linear_paths"]
    # 4 linears per decoder layer, and the embedding table (its tied head) on its own path
    assert sum(v["layers"] for v in paths.values()) == 4 * info["layers"] + 1 and info["loaded"]["dtype"] == "bfloat16"
    table = qpage("inspect", str(out), "--dtype", "bfloat16").stdout
    assert "int4 g64 asym" in table and "4.31" in table and "linear layers" in table, table
    assert "perplexity, python-docs" in table, table
    assert all(f"on {p} " in table for p in paths), table
    r = subprocess.run([sys.executable, "-m", "qpage.cli", "quantize", "default", str(out), "--scheme", "int4-rtn"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "already exists; choose a new output folder" in r.stderr
