"""Dense fp32 matmul on CPU: qpage's C panels (``cpu-dense``) against NumPy's OpenBLAS.

y = x W^T for the default model's shapes (fused qkv, gate/up, down, the 49152-row LM head)
and two of Llama-3-8B, at M rows. Each engine runs in its own process (two thread pools
spinning on the same cores slow each other), rounds alternate between them, and each figure
is the median over rounds of the per-round median time; the table gives OpenBLAS's time and
the panels' speed-up over it (> 1: the panels are faster). Both use every core.

    python benchmarks/dense_matmul.py [--rounds 3] [--m 1 4 16 64 256 512]
                                      [--out benchmarks/results/dense_matmul.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [("smol qkv", 576, 960), ("smol gate_up", 576, 3072), ("smol down", 1536, 576),
          ("smol head", 576, 49152), ("8B o_proj", 4096, 4096), ("8B gate", 4096, 14336)]
ENGINES = ("openblas", "panels")


def child(engine: str, ms: list[int], budget_s: float) -> dict[str, float]:
    """Median seconds per call of each (shape, m) on one engine."""
    import numpy as np
    import torch

    from qpage.kernels.cpu.matmul import blas
    from qpage.kernels.cpu.matmul.dense import DensePanels
    from qpage.kernels.cpu.native import num_threads

    torch.set_num_threads(1)
    blas.set_threads(num_threads() if engine == "openblas" else 1)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        if engine == "openblas":
            w_t = w.t().contiguous().numpy()
            fn = lambda x: np.matmul(x.numpy(), w_t)  # noqa: E731
        else:
            fn = DensePanels(w)
        del w
        for m in ms:
            x = torch.randn(m, k, generator=g)
            fn(x)
            t0 = time.perf_counter()
            fn(x)
            reps = max(1, min(200, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    fn(x)
                times.append((time.perf_counter() - t) / reps)
            out[f"{name}|{m}"] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 4, 16, 64, 256, 512])
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per timed repetition (about)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dense_matmul.json"))
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.m, args.budget)), flush=True)
        return
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    for r in range(args.rounds):
        for engine in ENGINES:
            print(f"round {r + 1}/{args.rounds}: {engine} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--child", engine, "--budget", str(args.budget),
                   "--m", *map(str, args.m)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"{engine} failed:\n{proc.stderr[-3000:]}")
            runs[engine].append(json.loads(line[len("RESULT "):]))
    rows: list[dict[str, Any]] = []
    print(f"\n{'shape':<14}{'k':>6}{'n':>7}{'m':>5}{'OpenBLAS ms':>13}{'panels speed-up':>17}")
    for name, k, n in SHAPES:
        for m in args.m:
            key = f"{name}|{m}"
            blas_s = statistics.median(run[key] for run in runs["openblas"])
            panels_s = statistics.median(run[key] for run in runs["panels"])
            rows.append(dict(shape=name, k=k, n=n, m=m, openblas_ms=1000 * blas_s, panels_ms=1000 * panels_s,
                             speedup=blas_s / panels_s))
            print(f"{name:<14}{k:>6}{n:>7}{m:>5}{1000 * blas_s:>13.3f}{blas_s / panels_s:>17.2f}")
    speedups = [r["speedup"] for r in rows]
    print(f"\npanels speed-up over OpenBLAS: min {min(speedups):.2f}, median {statistics.median(speedups):.2f}, "
          f"max {max(speedups):.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": args.rounds, "rows": rows, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
