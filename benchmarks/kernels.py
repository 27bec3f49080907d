"""Kernel speed on a CUDA GPU: qpage's Triton kernels against torch FP16 (cuBLAS / SDPA).

Shapes are Llama-3-8B's: linears K x N in {4096x4096, 4096x14336, 14336x4096,
4096x128256} at M in {1, 4, 16, 64, 256}; paged decode attention for 32 sequences x 4096
tokens (32 query heads, 8 kv heads, head_dim 128); prefill attention over a 4096-token
context; the cache write; batch-1 linears at N=14336 and K from 512 to 8192, to split their
time into a fixed cost and a cost per row (``kernels_scaling``); and one end-to-end decode
figure for a synthetic 8B-shaped layer stack (random weights, kernels only: no sampler,
scheduler or tokenizer).

Method: every timed call is captured in a CUDA graph together with calls on other copies of
its inputs (rotated so the bytes read exceed 4x the L2 cache), and the graph is replayed;
the figure is the median per call. Achieved GB/s counts the fewest bytes a call must move
(weights, activations, outputs; K/V and scales for attention) and is printed beside the
device-to-device copy bandwidth measured at the start (read + write), the practical peak.
Each kernel is also checked against its ``*_ref`` on the same inputs before it is timed.

    python benchmarks/kernels.py [--out benchmarks/results/kernels.json] [--quick]
    python benchmarks/kernels.py --interpret     # CPU dry run: tiny shapes, Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import write_json
from kernel_common import (
    DATASHEET_GBS,
    Timer,
    fill_cache,
    make_awq4,
    make_fp8,
    make_int4,
    make_int8,
    measure_copy_gbs,
    rel_err,
)
from kernels_attention import bench_attention, bench_cache_write
from kernels_scaling import bench_scaling

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B_LINEARS = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256)]
M_VALUES = [1, 4, 16, 64, 256]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    p.add_argument("--interpret", action="store_true", help="CPU dry run under TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--quick", action="store_true", help="fewer M values and no tuning sweep")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end decode figure")
    p.add_argument("--sections", default="",
                   help="comma-separated subset: cache_write,attention,linears,scaling,e2e")
    p.add_argument("--tune", action="store_true",
                   help="first sweep kernel configurations (benchmarks/kernel_tune.py), write this GPU's table to "
                        "<out dir>/configs/ and time the other sections with it")
    p.add_argument("--tune-budget", type=float, default=240.0, help="seconds the sweep may take (default 240)")
    return p.parse_args()


def applies(name: str, m: int) -> bool:
    """Whether variant ``name`` is timed at M rows: the tiled ``tl.dot`` kernel at M=1 and the
    GEMV with its K loop not pipelined (``int4-nopipe``: one stage) beside the GEMV the engine
    runs there, and the fused tiled kernel where dequantize-then-cuBLAS is the default
    (``int4-fused``, from ``configs.DEQUANT_MIN_M`` rows); every other variant at every M."""
    from qpage.kernels.configs import DEQUANT_MIN_M

    if name in ("int4-dot", "int4-nopipe"):
        return m == 1
    if name == "int4-fused":
        return m >= DEQUANT_MIN_M
    return True


Variant = tuple[dict[str, Any], Callable[..., Any], Callable[..., Any], int]


def _linear_variants(k: int, n: int, device: Any) -> dict[str, Variant]:
    """name -> (weights, run(x, weights), reference(x, weights), weight bytes) for one K x N
    linear: the integer layouts and FP8 as the engine runs them, and INT4 again under other
    configs (``applies``)."""
    from qpage.kernels.configs import default_matmul_config
    from qpage.kernels.fp8.matmul import fp8_matmul, fp8_matmul_ref
    from qpage.kernels.int_matmul import choose_config, int_matmul
    from qpage.kernels.packing import int_matmul_ref

    variants: dict[str, Variant] = {}
    layouts = {"int4-g128": (make_int4(k, n, 128, device), 4, 128, False),
               "int8-chan": (make_int8(k, n, device), 8, k, False),
               "awq-g128": (make_awq4(k, n, 128, device), 4, 128, True)}
    for name, (params, bits, group, awq) in layouts.items():
        kw = dict(bits=bits, group_size=group, awq=awq)
        variants[name] = (params,
                          lambda x, p, config=None, kw=kw: int_matmul(x, p["qweight"], p["scales"], None, None,
                                                                      config=config, **kw),
                          lambda x, p, kw=kw: int_matmul_ref(x, p["qweight"], p["scales"], None, None, **kw),
                          k * n * bits // 8 + params["scales"].numel() * 2)

    def alt(base: str, config_of: Callable[[Any], Any]) -> Variant:
        params, run, ref, nbytes = variants[base]
        return params, lambda x, p: run(x, p, config=config_of(x)), ref, nbytes

    variants["int4-dot"] = alt("int4-g128", lambda x: default_matmul_config(1, n, k, x.device, 128, kind="tiled"))
    # The GEMV the engine runs at M=1 (tuned or default tiles), its K loop in one stage.
    variants["int4-nopipe"] = alt("int4-g128", lambda x: replace(
        choose_config(x.device, 1, n, k, 4, 128, False, False), kind="gemv", num_stages=1))
    variants["int4-fused"] = alt("int4-g128", lambda x: default_matmul_config(x.shape[0], n, k, x.device, 128,
                                                                              kind="tiled"))
    for name, block in (("fp8-chan", False), ("fp8-block", True)):
        f8 = make_fp8(k, n, device, block)
        variants[name] = (f8, lambda x, p: fp8_matmul(x, p["weight"], p["scale"]),
                          lambda x, p: fp8_matmul_ref(x, p["weight"], p["scale"]), k * n + f8["scale"].numel() * 4)
    return variants


def _time_linear(x: Any, w16: Any, variants: dict[str, Variant], timer: Timer) -> dict[str, Any]:
    """One row: x @ w16.T in fp16 (cuBLAS) and each variant that applies at this M, timed over
    enough weight copies to defeat L2, with its error against its reference."""
    import torch

    (m, k), n = x.shape, w16.shape[0]
    io_bytes = (m * k + m * n) * x.element_size()
    fp16_bytes = k * n * w16.element_size() + io_bytes
    ws = [w16] + [torch.randn_like(w16) * 0.02 for _ in range(timer.copies(fp16_bytes) - 1)]
    t16 = timer.time([lambda w=w: x @ w.T for w in ws])
    row: dict[str, Any] = dict(K=k, N=n, M=m, fp16_us=t16 * 1e6, fp16_gbs=fp16_bytes / t16 / 1e9)
    for name, (params, fn, ref, wbytes) in variants.items():
        if not applies(name, m):
            continue
        err = rel_err(fn(x, params), ref(x, params))
        nbytes = wbytes + io_bytes
        copies = [params] + [{key: v.clone() for key, v in params.items()} for _ in range(timer.copies(nbytes) - 1)]
        t = timer.time([lambda p=p: fn(x, p) for p in copies])
        row.update({f"{name}_us": t * 1e6, f"{name}_gbs": nbytes / t / 1e9, f"{name}_speedup": t16 / t,
                    f"{name}_relerr": err})
    return row


def bench_linears(args: argparse.Namespace, device: Any, timer: Timer, peak: float) -> list[dict[str, Any]]:
    """Every weight format at the Llama-3-8B linears' shapes and each M, against fp16 cuBLAS."""
    import torch

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = LLAMA3_8B_LINEARS if not args.interpret else [(256, 128), (128, 384)]
    ms = ([1, 16, 256] if args.quick else M_VALUES) if not args.interpret else [1, 16]
    rows = []
    for k, n in shapes:
        w16 = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        variants = _linear_variants(k, n, device)
        for m in ms:
            row = _time_linear(torch.randn(m, k, device=device, dtype=dtype), w16, variants, timer)
            rows.append(row)
            print(f"  linear K={k:>5} N={n:>6} M={m:>3}  fp16 {row['fp16_us']:8.1f} us  "
                  + "  ".join(f"{nm} {row[nm + '_us']:7.1f} us ({row[nm + '_speedup']:.2f}x)" for nm in variants
                              if nm + "_us" in row),
                  flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


# ------------------------------------------------------------------------ end to end


def bench_e2e(args: argparse.Namespace, device: Any, timer: Timer) -> list[dict[str, Any]]:
    """Decode steps/s of a synthetic Llama-3-8B-shaped stack: FP16 (cuBLAS + paged FP16 KV)
    vs qpage INT4 g128 with the FP16 cache and with the FP8 per-token cache, batch 1, 8 and
    32, context 4096, CUDA graphs."""
    import torch

    from qpage.kernels.attention.cache_write import write_kv_cache
    from qpage.kernels.attention.decode import paged_attention_decode
    from qpage.kernels.int_matmul import int_matmul

    if device.type != "cuda":
        layers, hidden, inter, heads, kvh, dim, ctx, vocab = 1, 128, 256, 4, 2, 32, 32, 512
    else:
        layers, hidden, inter, heads, kvh, dim, ctx, vocab = 32, 4096, 14336, 32, 8, 128, 4096, 128256
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    rows = []
    for batch in (1, 8, 32) if device.type == "cuda" else (1, 2):
        for mode in ("fp16", "int4", "int4+fp8kv"):
            fmt = "e4m3" if mode.endswith("fp8kv") else None
            caches = [fill_cache(batch, ctx, kvh, dim, dtype, fmt, True, device) for _ in range(layers)]
            shapes = [(hidden, (heads + 2 * kvh) * dim), (heads * dim, hidden), (hidden, 2 * inter), (inter, hidden)]
            if mode == "fp16":
                weights = [[torch.randn(n, k, device=device, dtype=dtype) * 0.02 for k, n in shapes]
                           for _ in range(layers)]
                head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02

                def linear(x: Any, w: Any) -> Any:
                    return x @ w.T
            else:
                weights = [[make_int4(k, n, 128, device) for k, n in shapes] for _ in range(layers)]
                head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02  # head stays fp16

                def linear(x: Any, w: Any) -> Any:
                    return int_matmul(x, w["qweight"], w["scales"], None, None, bits=4, group_size=128)
            x0 = torch.randn(batch, hidden, device=device, dtype=dtype)
            slots = torch.zeros(batch, dtype=torch.int32, device=device)  # rewrite one slot each step
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

            def step() -> Any:
                h = x0
                for lw, c in zip(weights, caches, strict=True):
                    a = torch.nn.functional.rms_norm(h, (hidden,))
                    qkv = linear(a, lw[0])
                    q, k, v = qkv.split([heads * dim, kvh * dim, kvh * dim], dim=-1)
                    write_kv_cache(k.view(batch, kvh, dim), v.view(batch, kvh, dim), c["k_cache"], c["v_cache"],
                                   slots, c["k_scale"], c["v_scale"], fmt)
                    o = paged_attention_decode(q.reshape(batch, heads, dim), c["k_cache"], c["v_cache"],
                                               c["block_tables"], lens, dim**-0.5, c["k_scale"], c["v_scale"], fmt,
                                               max_seq_len=ctx)
                    h = h + linear(o.reshape(batch, -1), lw[1])
                    gu = linear(torch.nn.functional.rms_norm(h, (hidden,)), lw[2])
                    g, u = gu.chunk(2, dim=-1)
                    h = h + linear(torch.nn.functional.silu(g) * u, lw[3])
                return torch.nn.functional.rms_norm(h, (hidden,)) @ head.T

            t = timer.time([step], reps=10)
            rows.append(dict(kernel=f"e2e decode step {mode} batch {batch} ctx {ctx}", us=t * 1e6,
                             tokens_per_s=batch / t))
            print(f"  e2e {mode} batch {batch}: {t * 1e3:.2f} ms/step, {batch / t:.0f} tokens/s", flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, str(ROOT))
    if args.interpret:
        device = torch.device("cpu")
        name, l2 = "cpu (Triton interpreter)", 0
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        name, l2 = props.name, props.L2_cache_size
    else:
        sys.exit("benchmarks/kernels.py needs a CUDA GPU; use --interpret for the CPU dry run")
    torch.manual_seed(0)
    timer = Timer(device, l2)
    copy_gbs = measure_copy_gbs(device)
    datasheet = next((v for k, v in DATASHEET_GBS.items() if k in name), float("nan"))
    peak = copy_gbs if copy_gbs == copy_gbs else 1.0
    import triton

    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"copy bandwidth {copy_gbs:.0f} GB/s (datasheet {datasheet:.0f})", flush=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                                  copy_gbs=copy_gbs, datasheet_gbs=datasheet)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("cache_write", lambda: bench_cache_write(args, device, timer)),
        ("attention", lambda: bench_attention(args, device, timer, peak)),
        ("linears", lambda: bench_linears(args, device, timer, peak)),
        ("scaling", lambda: bench_scaling(args, device, timer)),
    ]
    if args.tune:
        from kernel_tune import tune

        sections.insert(0, ("tune", lambda: tune(device, name, timer, args.tune_budget, args.interpret,
                                                   Path(args.out).parent)))
    if not args.no_e2e:
        sections.append(("e2e", lambda: bench_e2e(args, device, timer)))
    wanted = {x.strip() for x in args.sections.split(",") if x.strip()}
    for key, fn in sections:
        if wanted and key.split("_")[0] not in wanted and key not in wanted:
            continue
        try:
            result[key] = fn()
        except Exception as e:  # keep the other sections' figures
            import traceback

            traceback.print_exc()
            result[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{key} done at {time.perf_counter() - t0:.0f} s]", flush=True)
    out = write_json(result, args.out)
    print_tables(result, peak)
    print(f"wrote {out}")


def print_tables(result: dict[str, Any], peak: float) -> None:
    print(f"\n{result['device']}: copy bandwidth {result['copy_gbs']:.0f} GB/s "
          f"(datasheet {result['datasheet_gbs']:.0f})")
    lin = result.get("linears")
    if isinstance(lin, list):
        names = ["int4-g128", "int4-nopipe", "int4-dot", "int4-fused", "awq-g128", "int8-chan", "fp8-chan",
                 "fp8-block"]
        print(f"{'K':>6} {'N':>7} {'M':>4} {'fp16 us':>8} " + " ".join(f"{n + ' us (x, GB/s)':>28}" for n in names))
        for r in lin:
            cells = [f"{r[n + '_us']:8.1f} ({r[n + '_speedup']:4.2f}x {r[n + '_gbs']:5.0f})" if n + "_us" in r else "-"
                     for n in names]
            print(f"{r['K']:>6} {r['N']:>7} {r['M']:>4} {r['fp16_us']:8.1f} " + " ".join(f"{c:>28}" for c in cells))
        worst = {n: max(r[n + "_relerr"] for r in lin if n + "_relerr" in r) for n in names
                 if any(n + "_relerr" in r for r in lin)}
        print("max relative error vs *_ref: " + ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))
    for key in ("attention", "cache_write", "e2e"):
        rows = result.get(key)
        if not isinstance(rows, list):
            continue
        print()
        for r in rows:
            extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                             if k not in ("kernel", "us"))
            print(f"{r['kernel']:<64} {r['us']:10.1f} us  {extra}")
    tune = result.get("tune")
    if isinstance(tune, dict):
        print(f"\ntuning sweep (table written to {tune['path']}):")
        for r in tune["rows"]:
            if "skipped" in r:
                continue
            label = r["kind"] if "M" not in r else f"{r['kind']} M={r['M']} {r['K']}x{r['N']}"
            fp16 = f"fp16 {r['fp16_us']:7.1f} us  " if "fp16_us" in r else ""
            ratio = f" ({r['fp16_us'] / r['best_us']:4.2f}x fp16)" if "fp16_us" in r else ""
            print(f"  {label:<40} {fp16}heuristic {r['heuristic_us']:7.1f} us  best {r['best_us']:7.1f} us{ratio}")


if __name__ == "__main__":
    main()
