"""The benchmark scripts' smoke runs: the GPU kernel benchmark's CPU dry run (Triton
interpreter, tiny shapes, with the tuning sweep), the KV cache, CPU path and C attention
benchmarks at tiny settings; each runs end to end and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_benchmark_interpret_dry_run(tmp_path: Path) -> None:
    """All sections, the tuning sweep first: every kernel matches its reference, and the sweep
    writes a table the package accepts, which the later sections then run with."""
    from qpage.kernels.tuned import problems

    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--interpret", "--tune", "--out",
                        str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    for section in ("cache_write", "attention", "linears", "scaling", "e2e"):
        assert isinstance(res[section], list) and res[section], f"{section}: {res[section]}"
    errors = [row for section in ("cache_write", "attention", "e2e") for row in res[section] if "error" in row]
    assert not errors, errors
    assert all(row["bit_exact"] for row in res["cache_write"])
    # Under the interpreter everything computes in fp32: each kernel within 1e-4 of its reference.
    for section in ("linears", "scaling"):
        errs = {k: row[k] for row in res[section] for k in row if k.endswith("_relerr")}
        assert errs and max(errs.values()) < 1e-4, (section, errs)
    # The M=1 rows ran the GEMV (int4-nopipe forces it) beside the default.
    assert all("int4-nopipe_relerr" in row for row in res["linears"] if row["M"] == 1)
    assert all(row["relerr"] < 1e-4 for row in res["attention"] if "relerr" in row)
    fits = [row for row in res["scaling"] if "fixed_us" in row]
    assert {"fp16", "int4-g128", "fp8-chan"} <= {row["kernel"] for row in fits}, fits
    table = json.loads((tmp_path / "configs" / "cpu_triton_interpreter.json").read_text())
    assert table == res["tune"]["table"] and problems(table) == [], problems(table)
    assert table["matmul"] and table["paged_decode"], "the sweep kept no configuration"
    assert all(row["best_us"] > 0 for row in res["tune"]["rows"] if "skipped" not in row)


def test_tuner_candidates_fit_the_kernels() -> None:
    """Every configuration the GPU sweep tries is one a table may hold and, for the integer
    matmul, one whose kernel runs the problem it is tried on (checked without a GPU)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from dataclasses import asdict

    from kernel_tune import _problems, decode_candidates, matmul_candidates

    from qpage.kernels.int_matmul.select import reject
    from qpage.kernels.tuned import problems

    table: dict = {"device": "test", "matmul": {}, "paged_decode": {}}
    for kind, m, flat in _problems(False):
        cands = matmul_candidates(m, False, kind.startswith("fp8"), kind == "fp8-block")
        assert cands, (kind, m)
        for k in flat[::2]:
            for i, cfg in enumerate(cands):
                table["matmul"].setdefault(kind, {}).setdefault(f"{k}x{i + 1}", {})[str(m)] = asdict(cfg)
                if not kind.startswith("fp8"):
                    bits, group = (4, 128) if kind == "int4-g128" else (8, k)
                    assert reject(cfg, m, bits, group, False, False) is None, (kind, m, k, cfg)
                else:
                    assert cfg.kind == "tiled", cfg
    for fp8 in (False, True):
        for i, dcfg in enumerate(decode_candidates(False, fp8)):
            table["paged_decode"][f"{fp8}/{i}"] = asdict(dcfg)
    assert problems(table) == [], problems(table)[:5]


def test_gpu_run_script_is_valid_bash() -> None:
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_run.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_kv_cache_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    # Any text will do for a smoke run (a clean clone may not sit beside ../shared/data).
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--windows", "1", "--window", "64",
                        "--chunk", "16", "--data", str(ROOT / "README.md"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    modes = {m["mode"]: m for m in res["modes"]}
    assert set(modes) == {"auto", "fp8_e4m3 per-token", "fp8_e4m3 per-tensor", "fp8_e5m2 per-token",
                          "fp8_e5m2 per-tensor", "int8 rotated", "int8 not rotated", "k8v4 rotated", "int4 rotated",
                          "int4 not rotated"}
    assert modes["fp8_e4m3 per-token"]["vs_fp16"] <= 0.53 and modes["int8 rotated"]["vs_fp16"] <= 0.53
    assert modes["int4 rotated"]["vs_fp16"] <= 0.30
    assert all(m["perplexity"] > 1 for m in modes.values())
    assert all(m["mean_kl"] >= 0 for m in modes.values())


def test_kv_cache_speed_smoke(tmp_path: Path) -> None:
    """--speed runs the fp32, FP8, int8 and int4 caches on their default backend (the C kernels
    read them all) and the FP8 per-token cache on cpu-blas for comparison, per context length."""
    from qpage.kernels.cpu import native as cpu_native

    out = tmp_path / "speed.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--speed", "--tokens", "4",
                        "--context", "40", "--rounds", "1", "--data", str(ROOT / "README.md"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["modes"]
    want = "cpu-native" if cpu_native.load() is not None else "cpu-blas"
    assert [row["attention_backend"] for row in rows] == [want] * 5 + ["cpu-blas"]
    assert [row["mode"] for row in rows] == ["auto", "fp8_e4m3 per-token", "int8 rotated", "k8v4 rotated",
                                             "int4 rotated", "fp8_e4m3 per-token"]
    assert all(row["batch1_tok_s"] > 0 and row["batch8_tok_s"] > 0 and row["context"] == 40 for row in rows)
    assert rows[0]["batch8_vs_auto"] == 1.0


def test_cpu_paths_benchmark_smoke(tmp_path: Path) -> None:
    """The CPU path benchmark runs (default-model shapes, M=1, no end-to-end part) and every
    packed layer (torch's and the blocks) is smaller than its fp32 dequantized copy: 1/6 for
    INT4, 1/3 for INT8. torch's int8pack holds one scale per channel, so the grouped INT8 rows
    have no torch packed path."""
    out = tmp_path / "cpu_paths.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_paths.py"), "--small", "--m", "1", "--reps",
                        "1", "--no-e2e", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["layers"]
    assert len(rows) == 12 and all(row["blocks (C)"] > 0 for row in rows)
    for row in rows:
        limit = 6 if row["scheme"].startswith("int4") else 3
        assert row["bytes"]["blocks"] * limit < row["bytes"]["fp32 dequant"], row
        if row["scheme"].startswith("int8"):
            assert row["bf16 packed"] is None and row["bytes"]["packed"] is None, row
            continue
        assert row["bf16 packed"] > 0 and row["bytes"]["packed"] * limit < row["bytes"]["fp32 dequant"], row


def test_cpu_attention_kernels_benchmark_smoke(tmp_path: Path) -> None:
    """Every cache mode's C decode kernel runs, interleaved, and is reported against fp32."""
    out = tmp_path / "cak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attention_kernels.py"), "--rounds", "1",
                        "--reps", "1", "--contexts", "40", "--batches", "1,2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["context"], row["batch"]) for row in rows] == [(40, 1), (40, 2)]
    for row in rows:
        assert len(row["us"]) == 8 and all(t > 0 for t in row["us"].values())
        assert row["vs_fp32"]["fp32"] == 1.0


def test_scaling_line_fit() -> None:
    """The scaling section's fit recovers a known intercept and slope."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernels_scaling import line_fit

    fixed, slope = line_fit([512.0, 1024.0, 2048.0, 4096.0], [3.0 + 0.004 * k for k in (512, 1024, 2048, 4096)])
    assert abs(fixed - 3.0) < 1e-9 and abs(slope - 0.004) < 1e-12
