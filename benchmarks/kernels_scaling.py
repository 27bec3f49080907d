"""The ``scaling`` section of ``kernels.py``: batch-1 linears timed at growing K, N fixed.

Why: on the H200 the M=1 kernels for 4096x14336 all took 22-28 us whatever their bytes
(INT4 29 MB, INT8 and FP8 58 MB), while cuBLAS fp16 moved 117 MB in 35 us. If a fixed cost
(launch, the split-K reduction's round trip, a partial last wave of programs) makes up most
of those 22 us, fewer instructions per weight cannot bring INT4 to 3x fp16 (~12 us); if the
time grows with K, they can. A straight line through time against K separates the two: its
intercept is the fixed cost per call, its slope the cost per row of weights (printed as the
GB/s the slope streams at).
"""

from __future__ import annotations

import argparse
from typing import Any

from kernel_common import Timer, make_fp8, make_int4, rel_err


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def bench_scaling(args: argparse.Namespace, device: Any, timer: Timer) -> list[dict[str, Any]]:
    import torch

    from qpage.kernels.fp8.matmul import fp8_matmul, fp8_matmul_ref
    from qpage.kernels.int_matmul import int_matmul
    from qpage.kernels.packing import int_matmul_ref

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    n, ks = (14336, [512, 1024, 2048, 4096, 8192]) if not args.interpret else (128, [128, 256, 512])
    kernels = ["fp16", "int4-g128", "fp8-chan"]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    rows = []
    for k in ks:
        x = torch.randn(1, k, device=device, dtype=dtype)
        w16 = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        q4 = make_int4(k, n, 128, device)
        f8 = make_fp8(k, n, device, False)

        def int4(xx: Any, p: dict[str, Any]) -> Any:
            return int_matmul(xx, p["qweight"], p["scales"], None, None, bits=4, group_size=128)

        def int4_ref(xx: Any, p: dict[str, Any]) -> Any:
            return int_matmul_ref(xx, p["qweight"], p["scales"], None, None, bits=4, group_size=128)

        cases = {"fp16": ({"w": w16}, lambda xx, p: xx @ p["w"].T, lambda xx, p: xx.float() @ p["w"].float().T,
                          n * k * 2),
                 "int4-g128": (q4, int4, int4_ref, n * k // 2 + q4["scales"].numel() * 2),
                 "fp8-chan": (f8, lambda xx, p: fp8_matmul(xx, p["weight"], p["scale"]),
                              lambda xx, p: fp8_matmul_ref(xx, p["weight"], p["scale"]), n * k + n * 4)}
        row: dict[str, Any] = dict(K=k, N=n, M=1)
        for name in kernels:
            params, fn, ref, wbytes = cases[name]
            row[f"{name}_relerr"] = rel_err(fn(x, params), ref(x, params))
            nc = timer.copies(wbytes)
            copies = [params] + [{key: v.clone() for key, v in params.items()} for _ in range(nc - 1)]
            t = timer.time([lambda p=p: fn(x, p) for p in copies])
            row[f"{name}_us"] = t * 1e6
            times[name].append(t * 1e6)
        rows.append(row)
        print(f"  scaling N={n} K={k:>5} M=1  " + "  ".join(f"{nm} {row[nm + '_us']:6.1f} us" for nm in kernels),
              flush=True)
    for name in kernels:
        fixed, per_k = line_fit([float(k) for k in ks], times[name])
        bytes_per_k = n * (2 if name == "fp16" else 1 if name == "fp8-chan" else 0.5)
        gbs = bytes_per_k / (per_k * 1e-6) / 1e9 if per_k > 0 else float("nan")
        rows.append(dict(kernel=name, fixed_us=fixed, us_per_1k_rows=per_k * 1000, slope_gbs=gbs))
        print(f"  scaling {name:10s}: {fixed:6.1f} us fixed + {per_k * 1000:6.2f} us per 1024 rows of K "
              f"(the slope streams {gbs:6.0f} GB/s)", flush=True)
    return rows
