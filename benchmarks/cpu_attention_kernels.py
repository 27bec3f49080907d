"""Decode attention kernels in C on CPU, per KV cache mode: microseconds per call.

The default model's heads (9 query heads, 3 KV heads, head_dim 64), contexts of 512 and
2048 tokens in shuffled 16-token blocks, batch 1 and 8. Every round times each mode once,
in turn, so that the machine's noise falls on all of them alike; the table shows the median
over rounds and each mode's ratio to the fp32 cache's median.

    python benchmarks/cpu_attention_kernels.py        # table + benchmarks/results/cpu_attention_kernels.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MODES = ("fp32", "fp8_e4m3 per-token", "fp8_e4m3 per-tensor", "fp8_e5m2 per-token", "fp8_e5m2 per-tensor", "int8",
         "k8v4", "int4")


def make_calls(n: int, ctx: int) -> dict[str, Callable[[], Any]]:
    """One decode call per mode over the same keys and values (written through each cache's own write)."""
    import torch

    from qpage.kernels.cpu.attention import native_fp32
    from qpage.kernels.cpu.attention.native_fp8 import paged_decode_fp8, write_kv_fp8
    from qpage.kernels.cpu.attention.native_int import paged_decode_int, write_int
    from qpage.kernels.kv_int import PARAMS, code_width

    g = torch.Generator().manual_seed(0)
    per_seq = math.ceil(ctx / BLOCK)
    nb = n * per_seq + 2
    table = torch.randperm(nb, generator=g)[: n * per_seq].view(n, per_seq).to(torch.int32)
    pos = torch.arange(ctx)
    slots = torch.cat([table[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK for i in range(n)])
    k = torch.randn(n * ctx, KV_HEADS, HEAD_DIM, generator=g) * 2
    v = torch.randn(n * ctx, KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    lens = torch.full((n,), ctx, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    kc = torch.zeros(nb, BLOCK, KV_HEADS, HEAD_DIM)
    vc = torch.zeros_like(kc)
    kc.view(-1, KV_HEADS, HEAD_DIM)[slots] = k
    vc.view(-1, KV_HEADS, HEAD_DIM)[slots] = v
    calls: dict[str, Callable[[], Any]] = {"fp32": lambda: native_fp32.paged_decode(q, kc, vc, table, lens, scale)}
    for fmt in ("e4m3", "e5m2"):
        for per_token in (True, False):
            k8 = torch.zeros(nb, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.uint8)
            v8 = torch.zeros_like(k8)
            if per_token:
                ks = torch.zeros(nb, BLOCK, KV_HEADS, dtype=torch.float16)
                vs = torch.zeros_like(ks)
            else:
                ks, vs = k.abs().max() / 448, v.abs().max() / 448
            write_kv_fp8(k, v, k8, v8, slots, ks, vs, fmt)
            name = f"fp8_{fmt} {'per-token' if per_token else 'per-tensor'}"
            calls[name] = (lambda k8=k8, v8=v8, ks=ks, vs=vs, fmt=fmt:
                           paged_decode_fp8(q, k8, v8, ks, vs, fmt, table, lens, scale))
    int_caches = {}
    for bits in (8, 4):
        codes = torch.zeros(nb, BLOCK, KV_HEADS, code_width(bits, HEAD_DIM), dtype=torch.int8 if bits == 8
                            else torch.uint8)
        ki, vi = codes, torch.zeros_like(codes)
        kp = torch.zeros(nb, BLOCK, KV_HEADS, PARAMS[bits], dtype=torch.float16)
        vp = torch.zeros_like(kp)
        write_int(k, ki, kp, slots, bits)
        write_int(v, vi, vp, slots, bits)
        int_caches[bits] = (ki, kp), (vi, vp)
    for name, (kb, vb) in (("int8", (8, 8)), ("k8v4", (8, 4)), ("int4", (4, 4))):
        (ki, kp), (vi, vp) = int_caches[kb][0], int_caches[vb][1]
        calls[name] = (lambda ki=ki, vi=vi, kp=kp, vp=vp, kb=kb, vb=vb:
                       paged_decode_int(q, ki, vi, kp, vp, kb, vb, table, lens, scale))
    return calls


def time_rounds(calls: dict[str, Callable[[], Any]], rounds: int, reps: int) -> dict[str, float]:
    """Median microseconds per call of each mode over ``rounds`` interleaved rounds."""
    for fn in calls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            samples[name].append((time.perf_counter() - t) / reps * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=50, help="calls per mode per round")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_attention_kernels.json")
    args = ap.parse_args()
    from qpage.kernels.cpu import native as cpu_native

    if cpu_native.load() is None:
        raise SystemExit(f"the C kernels are unavailable: {cpu_native.unavailable_reason()}")
    rows = []
    print(f"{'context':>7} {'batch':>5}  " + "  ".join(f"{m:>22}" for m in MODES))
    for ctx in (int(c) for c in args.contexts.split(",")):
        for n in (int(b) for b in args.batches.split(",")):
            med = time_rounds(make_calls(n, ctx), args.rounds, args.reps)
            rows.append(dict(context=ctx, batch=n, us=med, vs_fp32={m: med[m] / med["fp32"] for m in MODES}))
            print(f"{ctx:>7} {n:>5}  " + "  ".join(f"{med[m]:9.1f} us ({med[m] / med['fp32']:4.2f}x)"
                                                   for m in MODES), flush=True)
    write_json({"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rounds": args.rounds,
                "reps": args.reps, "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
