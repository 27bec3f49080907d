"""The GPU kernel benchmark's CPU dry run (Triton interpreter, tiny shapes) and the KV cache
quality benchmark (tiny settings) run end to end and write their JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_benchmark_interpret_dry_run(tmp_path: Path) -> None:
    """All sections, the tuning sweep first: it writes a usable table that the later sections use."""
    from qpage.kernels.tuned import problems

    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--interpret", "--tune", "--out",
                        str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    for section in ("cache_write", "attention", "linears", "scaling", "e2e"):
        assert isinstance(res[section], list) and res[section], f"{section}: {res[section]}"
    fits = {row["kernel"]: row for row in res["scaling"] if "fixed_us" in row}
    assert set(fits) == {"fp16", "int4-g128", "int4-h2", "fp8-chan"}, fits
    assert max(r[k] for r in res["scaling"] for k in r if k.endswith("_relerr")) < 1e-4
    assert all(row["bit_exact"] for row in res["cache_write"])
    assert max(r[k] for r in res["linears"] for k in r if k.endswith("_relerr")) < 1e-4
    assert all(row["relerr"] < 1e-4 for row in res["attention"] if "relerr" in row)
    t_rows = [row["kernel"] for row in res["attention"] if "tokens-as-rows" in row["kernel"]]
    # (4 settings + all loads pipelined x 2 query forms) x e4m3 per-token, per-tensor; e5m2 per-token (q fp16, 2)
    assert len(t_rows) == 14, t_rows
    table = json.loads((tmp_path / "configs" / "cpu_triton_interpreter.json").read_text())
    assert table == res["tune"]["table"] and problems(table) == []
    assert table["matmul"], "the sweep kept no configuration"
    assert all(row["best_us"] > 0 for row in res["tune"]["rows"] if "skipped" not in row)


def test_kv_cache_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    # Any text will do for a smoke run (a clean clone may not sit beside ../shared/data).
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--windows", "1", "--window", "64",
                        "--chunk", "16", "--data", str(ROOT / "README.md"), "--out", str(out), "--q-fp8"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    modes = {m["mode"]: m for m in res["modes"]}
    assert set(modes) == {"auto", "fp8_e4m3 per-token", "fp8_e4m3 per-tensor", "fp8_e5m2 per-token",
                          "fp8_e5m2 per-tensor", "e4m3 per-token q-fp8", "e4m3 per-token q-hi+lo",
                          "e4m3 per-tensor q-hi+lo"}
    # The rounded queries change the scores (an unpatched engine would give exactly the same KL).
    assert modes["e4m3 per-token q-fp8"]["mean_kl"] != modes["fp8_e4m3 per-token"]["mean_kl"]
    assert modes["fp8_e4m3 per-token"]["vs_fp16"] <= 0.53
    assert all(m["perplexity"] > 1 for m in modes.values())


def test_h2_numerics_benchmark_smoke(tmp_path: Path) -> None:
    """The half2 numerics benchmark quantizes the default model, scores one short window with
    both arithmetics and reports a small, nonzero difference (the two paths do differ: an
    emulation that fell back to the fp32 one would give exactly 0)."""
    out = tmp_path / "h2.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h2_numerics.py"), "--windows", "1", "--window",
                        "48", "--chunk", "16", "--data", str(ROOT / "README.md"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tokens_scored"] == 47 and all(p > 1 for p in res["perplexity"].values())
    assert 0 < res["mean_kl"] < 1e-3 and abs(res["ppl_delta_pct"]) < 1.0, res


def test_kv_cache_speed_smoke(tmp_path: Path) -> None:
    """--speed runs every mode on its default backend (the C kernels read FP8 caches too) and
    the FP8 per-token cache on cpu-blas for comparison."""
    from qpage.kernels import cpu_native

    out = tmp_path / "speed.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--speed", "--tokens", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["modes"]
    want = "cpu-native" if cpu_native.load() is not None else "cpu-blas"
    assert [row["attention_backend"] for row in rows] == [want] * 5 + ["cpu-blas"]
    assert all(row["batch1_tok_s"] > 0 and row["batch8_tok_s"] > 0 for row in rows)


def test_cpu_paths_benchmark_smoke(tmp_path: Path) -> None:
    """The CPU path benchmark runs (default-model shapes, M=1, no end-to-end part) and every
    packed layer is smaller than its fp32 dequantized copy: 1/6 for INT4, 1/3 for INT8."""
    out = tmp_path / "cpu_paths.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_paths.py"), "--small", "--m", "1", "--reps",
                        "1", "--no-e2e", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["layers"]
    assert len(rows) == 9 and all(row["bf16 packed"] > 0 for row in rows)
    for row in rows:
        limit = 6 if row["scheme"].startswith("int4") else 3
        assert row["bytes"]["packed"] * limit < row["bytes"]["fp32 dequant"], row


def test_kernel_sass_counts_the_gemv_loop(tmp_path: Path) -> None:
    """The static SASS count compiles the GEMV kernels for sm_90 with Triton's bundled ptxas
    (no GPU) and finds their main loops; the in-place kernel, which exists to cut instructions
    per weight, must still use fewer than the shift kernel, the half2 kernel fewer than the
    in-place one, and none may spill; likewise the pairs kernel against the general tl.dot
    kernel at a decode batch tile."""
    out = tmp_path / "sass.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--arch", "90", "--quick",
                        "--attention", "--small-m", "--fp8-matmul", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    # FP8 weights on sm_90 decode in hardware; the PTX decoder's win is on sm_80/86 (NOTES-kernels.md).
    assert res["fp8_matmul"] and all(r["fp8_cvt"] == "hw" and r["spill_bytes"] == 0 for r in res["fp8_matmul"])
    # Decode batches: the pairs kernel exists to cut the general tl.dot kernel's per-weight
    # unpacking and 16-bit shared-memory stores, on the same 16x128x128 tile.
    small = {row["kernel"]: row for row in res["small_m"]}
    assert set(small) == {"tl.dot", "pairs"} and all(row["spill_bytes"] == 0 for row in small.values())
    assert small["pairs"]["per_weight"] < 0.85 * small["tl.dot"]["per_weight"], small
    rows = {row["kernel"]: row for row in res["rows"] if row["loop_stages"] == 2}
    assert set(rows) == {"in-place", "shift", "half2"}
    for row in res["rows"]:
        assert row["spill_bytes"] == 0 and row["registers"] > 0
        assert 2.0 < row["per_weight"] < 20.0, row  # a loop over the weights, not some other loop
        # The GEMVs' K loop is pipelined through tl.range (the kernel argument alone pipelines
        # only loads feeding tl.dot): the words of later tiles arrive by async copy in the loop.
        assert (row["ldgsts_in_loop"] > 0) == (row["loop_stages"] > 1), row
    assert {row["kernel"] for row in res["rows"] if row["loop_stages"] == 1} == {"in-place", "half2"}
    assert rows["in-place"]["per_weight"] < 0.8 * rows["shift"]["per_weight"], rows
    # The half2 GEMV (its inline PTX, which ptxas has now accepted) exists to take two weights
    # per instruction: it must count well under the in-place kernel.
    assert rows["half2"]["per_weight"] < 0.8 * rows["in-place"]["per_weight"], rows
    # Decode attention: staging FP8 V as fp16 exists to replace byte-wise operand gathers from
    # shared memory; it must still cut the loop's shared-memory loads and its instructions.
    # A bf16 model's FP8 codes are multiplied in fp16 (no fp16 -> fp32 -> bf16 per code): its
    # loop must count no more than the fp16 model's on the same settings.
    bf16 = next(a for a in res["attention"] if a["mode"] == "fp8 per-token bf16")
    f16 = next(a for a in res["attention"] if a["mode"] == "fp8 per-token" and a["v_f16"] == bf16["v_f16"]
               and a["num_warps"] == bf16["num_warps"] and not a["maxnreg"])
    assert bf16["loop_instructions"] <= 1.05 * f16["loop_instructions"], (bf16, f16)
    att = [a for a in res["attention"] if not a["mode"].startswith(("prefill", "decoder", "tokens-as-rows"))
           and not a["mode"].endswith("bf16")]
    assert {a["mode"] for a in att} == {"fp16", "fp8 per-token", "fp8 per-tensor"}
    # The tokens-as-rows decode (paged_decode_t) exists to run q K^T as FP8 wgmma (QGMMA) straight
    # from K's codes: with qk-fp8 it must, and its per-token loop must count under 0.75x the
    # default kernel's (per-token, V staged, 4 warps), unspilled, in more resident warps.
    t_rows = {(a["mode"], a["block_n"]): a for a in res["attention"] if a["mode"].startswith("tokens-as-rows")}
    assert len(t_rows) == 12 and all(a["spill_bytes"] == 0 for a in t_rows.values())
    from qpage.kernels.paged_decode_t import default_qk_fp8

    t = t_rows[("tokens-as-rows per-token qk-fp8" + ("" if default_qk_fp8() else " q_pad=16"), 64)]
    default = next(a for a in att if a["mode"] == "fp8 per-token" and a["v_f16"] and a["num_warps"] == 4)
    assert t["mma"].get("QGMMA", 0) > 0 and t_rows[("tokens-as-rows per-token", 64)]["mma"].get("QGMMA", 0) == 0
    assert t["loop_instructions"] < 0.75 * default["loop_instructions"], (t, default)
    assert t["warps_per_sm"] > default["warps_per_sm"], (t, default)
    # Its register cap on sm_90 (default_maxnreg) exists to fit more programs per SM at about
    # the same count; every load pipelined (loop_stages) exists to take the V words, scales and
    # block ids off plain loads (LDG) in the loop.
    capped = t_rows[("tokens-as-rows per-token qk-fp8", 64)]
    free = t_rows[("tokens-as-rows per-token qk-fp8 no cap", 64)]
    assert capped["registers"] <= 80 < free["registers"], (capped, free)
    assert capped["warps_per_sm"] > free["warps_per_sm"], (capped, free)
    assert capped["loop_instructions"] <= 1.1 * free["loop_instructions"], (capped, free)
    piped = t_rows[("tokens-as-rows per-token qk-fp8 loop_stages=3", 64)]
    assert piped["ldg_in_loop"] < capped["ldg_in_loop"], (piped, capped)
    # The packed PTX FP8 decoder (e5m2 on sm_90; e4m3 too on sm_80/86) exists to cut the
    # element-wise bit trick's instructions; its PTX is compiled here, so ptxas accepts it.
    dec = {a["fp8_cvt"]: a for a in res["attention"] if a["mode"] == "decoder e5m2"}
    assert set(dec) == {"bits", "ptx"} and dec["ptx"]["spill_bytes"] == 0
    assert dec["ptx"]["loop_instructions"] < 0.85 * dec["bits"]["loop_instructions"], dec
    prefill = {a["mode"]: a for a in res["attention"] if a["mode"].startswith("prefill")}
    assert len(prefill) == 4  # fp16, per-token (scales on scores / on K-V rows), per-tensor
    # On sm_90, the K/V-row scaling exists to cut the per-token loop's scale loads and registers.
    tok, rows_ = prefill["prefill fp8 per-token"], prefill["prefill fp8 per-token rows"]
    assert rows_["ldg_in_loop"] < tok["ldg_in_loop"] and rows_["registers"] < tok["registers"], (tok, rows_)
    for a in att:
        assert a["spill_bytes"] == 0 and a["warps_per_sm"] > 0 and a["loop_instructions"] > 100, a
        if a["maxnreg"]:  # 8 warps capped at 80 registers: three programs per SM on sm_90, unspilled
            assert a["registers"] <= a["maxnreg"] and a["warps_per_sm"] == 24, a
        elif a["v_f16"]:
            base = next(b for b in att if b["mode"] == a["mode"] and b["num_warps"] == a["num_warps"]
                        and not b["v_f16"])
            assert a["lds"] < 0.7 * base["lds"], (a, base)
            assert a["loop_instructions"] < 0.9 * base["loop_instructions"], (a, base)


def test_ptx_fp8_decoder_counts_on_sm86(tmp_path: Path) -> None:
    """On an RTX 3090 (sm_86, no e4m3 conversion) the packed PTX decoder exists to cut what
    the element-wise bit trick spends per code: compiled for sm_86 by ptxas (which thereby
    accepts it), the decode attention loop (e4m3 per-token, the sm_86 default settings) and
    the FP8 weight matmul's loop per weight must both count well under the bit trick's."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import kernel_sass as k; "
        "att = [k._decode_row(86, 'decoder e4m3', True, True, False, 4, 'e4m3', c) for c in (0, 1)]; "
        "mm = [r for r in k.fp8_matmul_rows([86]) if r['block_m'] == 16]; "
        "open(sys.argv[2], 'w').write(json.dumps(dict(att=att, mm=mm)))"
    )
    out = tmp_path / "sm86.json"
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), str(out)], capture_output=True,
                       text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    bits, ptx = res["att"]
    assert (bits["fp8_cvt"], ptx["fp8_cvt"]) == ("bits", "ptx") and ptx["spill_bytes"] == 0
    assert ptx["loop_instructions"] < 0.85 * bits["loop_instructions"], (bits, ptx)
    for tile in {(r["block_n"], r["block_k"]) for r in res["mm"]}:
        pair = {r["fp8_cvt"]: r for r in res["mm"] if (r["block_n"], r["block_k"]) == tile}
        assert pair["ptx"]["per_weight"] < 0.75 * pair["bits"]["per_weight"], pair


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
        assert len(row["us"]) == 5 and all(t > 0 for t in row["us"].values())
        assert row["vs_fp32"]["fp32"] == 1.0


def test_scaling_line_fit() -> None:
    """The scaling section's fit recovers a known intercept and slope."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernels_scaling import line_fit

    fixed, slope = line_fit([512.0, 1024.0, 2048.0, 4096.0], [3.0 + 0.004 * k for k in (512, 1024, 2048, 4096)])
    assert abs(fixed - 3.0) < 1e-9 and abs(slope - 0.004) < 1e-12
