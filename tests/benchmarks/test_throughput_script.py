"""The throughput benchmark still runs end to end (tiny settings) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_script_b1_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--b1-only",
                        "--b1-tokens", "8", "--requests", "2", "--kv-cache-memory", "64MiB", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "batch-1 decode tokens/s" in r.stdout
    res = json.loads(out.read_text())
    assert res["qpage"]["b1_decode_tokens_per_s"] > 0 and res["hf"]["b1_decode_tokens_per_s"] > 0
    assert res["b1_decode_ratio"] > 0
