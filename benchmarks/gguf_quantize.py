"""GGUF files written by ``qpage quantize --format gguf`` against llama.cpp's own
``llama_model_quantize`` of the same weights, scored by llama.cpp and by qpage.

The weights: the default model, written once as an F32 GGUF by qpage (its Q4_1 weights
exactly). For each file type, llama.cpp quantizes that F32 file (no importance matrix: the
tool's default) and qpage writes the same type from the default model, with scales weighted
by the inputs' E[x^2] on ``--samples`` windows of wikitext-2 ``valid.txt``, and without
calibration, and with GPTQ's error feedback inside the blocks (same windows). The tensor
types of both files must agree (the script stops if not), so the sizes are equal. Every
file is scored on the same token windows (wikitext-2 ``test.txt`` in domain,
``python-docs`` held out): by llama-cpp-python in its own process (logits of a fresh
512-token context per window), and by qpage's engine on the packed CPU kernels, with mean KL
against the F32 file. Needs llama-cpp-python.

    python benchmarks/gguf_quantize.py [--types q4_0 q4_k_m] [--variants imatrix gptq no-calibration]
        [--samples 32] [--windows 40] [--heldout-windows 12]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json
from quality import DATA, Scorer, windows

ROOT = Path(__file__).resolve().parent.parent
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16,
          "q5_k_m": 17, "q6_k": 18}
"""llama.cpp's file type ids (``llama_ftype``)."""
VARIANTS = {"imatrix": True, "gptq": True, "no-calibration": False}
"""qpage's ways of writing each type, and whether each calibrates."""
QUANTIZE_CHILD = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""
SCORE_CHILD = """
import json, math, sys, numpy as np, llama_cpp
wins = json.load(open(sys.argv[2]))
llm = llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[3]), n_batch=int(sys.argv[3]), logits_all=True,
                      n_threads=2, verbose=False)
out = {}
for label, ws in wins.items():
    nll, n = 0.0, 0
    for ids in ws:
        llm.reset()
        llm.eval(ids)
        x = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        m = x.max(1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(x - m).sum(1)))
        nll += float((lse - x[np.arange(len(ids) - 1), ids[1:]]).sum())
        n += len(ids) - 1
    out[label] = math.exp(nll / n)
print("RESULT " + json.dumps(out))
"""


def llama_score(path: Path, wins_file: Path, seq_len: int) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", SCORE_CHILD, str(path), str(wins_file), str(seq_len)],
                       capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        sys.exit(f"llama.cpp could not score {path}:\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def llama_quantize(src: Path, dst: Path, file_type: str) -> None:
    r = subprocess.run([sys.executable, "-c", QUANTIZE_CHILD, str(src), str(dst), str(FTYPES[file_type])],
                       capture_output=True, text=True)
    if r.returncode != 0 or not dst.is_file():
        sys.exit(f"llama_model_quantize failed for {file_type}:\n{r.stderr[-3000:]}")


def types_of(path: Path) -> dict[str, str]:
    from qpage.formats.gguf_reader import GgufFile

    return {n: t.type_name for n, t in GgufFile(path).tensors.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["q4_0", "q4_k_m"], choices=sorted(FTYPES))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--heldout-windows", type=int, default=12)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="qpage's files: importance-weighted scales, GPTQ in the blocks, no calibration")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_quantize.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from qpage.formats.gguf import default_gguf_path, default_model_dir
    from qpage.quantizers.gguf_pipeline import quantize_gguf

    hf = default_model_dir()
    calib, texts = windows(hf, args)
    work = Path(tempfile.mkdtemp(prefix="qpage-gguf-quality-"))
    wins_file = work / "windows.json"
    wins_file.write_text(json.dumps(texts))
    f32 = work / "f32.gguf"
    quantize_gguf(default_gguf_path(), f32, "f32", progress=False)
    scorer = Scorer(texts, args.seq_len, work)
    rows: list[dict[str, Any]] = []

    def add(label: str, path: Path, reference: bool = False) -> dict[str, Any]:
        q = scorer.reference(str(path)) if reference else scorer.score(str(path))
        ll = llama_score(path, wins_file, args.seq_len)
        row = {"file": label, "size_bytes": path.stat().st_size,
               "llama_cpp": ll, "qpage": {k: v["perplexity"] for k, v in q.items()},
               "mean_kl": {k: v["mean_kl"] for k, v in q.items()}}
        rows.append(row)
        print(f"{label:34s} " + "  ".join(f"{k}: llama.cpp {ll[k]:.4f} qpage {row['qpage'][k]:.4f}"
                                          for k in texts), flush=True)
        return row

    add("F32 (qpage writer)", f32, reference=True)
    for ft in args.types:
        ref = work / f"llama-{ft}.gguf"
        llama_quantize(f32, ref, ft)
        add(f"{ft.upper()} llama_model_quantize", ref)
        for how in args.variants:
            ours = work / f"qpage-{ft}-{how}.gguf"
            r = quantize_gguf(default_gguf_path(), ours, ft, calib=calib if VARIANTS[how] else None, calib_folder=hf,
                              gptq=how == "gptq", progress=False)
            if types_of(ours) != types_of(ref):
                diff = {n: (t, types_of(ref)[n]) for n, t in types_of(ours).items() if types_of(ref).get(n) != t}
                sys.exit(f"{ft}: tensor types differ from llama.cpp's: {diff}")
            add(f"{ft.upper()} qpage ({how})", ours)["quantize_seconds"] = r.seconds
        write_json({"seq_len": args.seq_len, "samples": args.samples,
                    "windows": {k: len(v) for k, v in texts.items()}, "rows": rows}, args.out)
    print_table(rows, list(texts))
    for p in work.glob("*"):
        p.unlink()
    work.rmdir()


def print_table(rows: list[dict[str, Any]], texts: list[str]) -> None:
    base = rows[0]
    print("\n| file | MB | " + " | ".join(f"{t}: llama.cpp | qpage | qpage/llama.cpp | KL" for t in texts) + " |")
    print("|---|---:|" + "---:|---:|---:|---:|" * len(texts))
    for r in rows:
        cells = []
        for t in texts:
            ll, q = r["llama_cpp"][t], r["qpage"][t]
            rel = f" ({100 * (ll / base['llama_cpp'][t] - 1):+.2f}%)" if r is not base else ""
            kl = r["mean_kl"][t]
            cells.append(f"{ll:.4f}{rel} | {q:.4f} | {q / ll:.4f} | {'' if kl is None else f'{kl:.4f}'}")
        print(f"| {r['file']} | {r['size_bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    print(f"\nmean over rows of |qpage/llama.cpp - 1|: "
          f"{np.mean([abs(r['qpage'][t] / r['llama_cpp'][t] - 1) for r in rows for t in texts]) * 100:.2f}%"
          f"; largest {max(abs(r['qpage'][t] / r['llama_cpp'][t] - 1) for r in rows for t in texts) * 100:.2f}%")
    _ = math


if __name__ == "__main__":
    main()
