"""The structured-output benchmark still runs end to end (tiny settings) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

ROOT = Path(__file__).resolve().parents[2]


def test_structured_output_script_smoke(tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "structured_output.py"), "--tokens", "8",
                        "--batch", "2", "--rounds", "1", "--schemas", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decode tokens/s" in r.stdout and "grammar libraries" in r.stdout
    res = json.loads(out.read_text())
    (row,) = res["speed"]
    assert row["batch"] == 2 and row["unconstrained_tok_s"] > 0 and row["json_schema_tok_s"] > 0
    assert [lib["library"].split()[0] for lib in res["libraries"]] == ["xgrammar", "llguidance"]
    assert all(lib["compile_ms"] > 0 and lib["mask_us"] > 0 for lib in res["libraries"])
    mask = res["engine_mask"]
    assert mask["batch"] == 2 and mask["mask_us_per_step"] > 0 and mask["xgrammar_apply_us"] > 0
