"""Tuning sweep for ``benchmarks/kernels.py --tune``: the fastest correct configuration of each
quantized matmul (Llama-3-8B shapes, several M) and of paged decode attention, on this GPU.

Every candidate is first checked against the ``*_ref`` reference on the same inputs (a
candidate whose output is off is rejected, never timed), then timed like the rest of
``kernels.py`` (CUDA graph, inputs rotated past the L2 cache), against the built-in default
(``configs.default_matmul_config``, ``configs.default_decode_config``). Problems are visited
in priority order (INT4 at M=1 first: batch-1 decode) until ``budget_s`` runs out; what was
not reached stays on the defaults. The result is a ``kernels.tuned`` table (``MatmulConfig``
and ``DecodeConfig`` fields only), written to ``<out dir>/configs/<device key>.json``; copy it
into ``qpage/kernels/gpu_tables/`` (``tuned.CONFIG_DIR``) to ship.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

INT_TOL = 1e-3
"""||out - ref|| / ||ref|| allowed of a matmul candidate (fp16 output rounding is ~3e-4)."""
DECODE_TOL = 2e-3
"""The same for a decode candidate, on the first two sequences."""


def _cfgs(**grid: Iterable[Any]) -> list[Any]:
    """Every ``MatmulConfig`` of the grid's product."""
    from qpage.kernels.configs import MatmulConfig

    out: list[dict[str, Any]] = [{}]
    for key, values in grid.items():
        out = [{**o, key: v} for o in out for v in values]
    return [MatmulConfig(**o) for o in out]


def matmul_candidates(m: int, interpret: bool, fp8: bool, block_scales: bool) -> list[Any]:
    """The ``MatmulConfig``s tried for M rows (interpreter: two, to exercise the plumbing). At
    M=1 the integer weights try the GEMV (``kind="gemv"``: its K loop pipelined 1-3 stages deep);
    elsewhere the tiled kernel (FP8's only kernel), and from 256 rows also dequantize-then-cuBLAS."""
    from qpage.kernels.configs import MatmulConfig

    if interpret:
        return [MatmulConfig(16, 32, 32, split_k=2), MatmulConfig(16, 64, 64, kind="gemv" if m == 1 and not fp8
                                                                  else "tiled")]
    bks = (64, 128)
    if m == 1 and not fp8:
        cands = _cfgs(block_m=[16], block_n=[64, 128, 256], block_k=[32, 64, 128], split_k=[4, 8, 16],
                      num_warps=[2, 4], num_stages=[2], kind=["gemv"])
        cands += _cfgs(block_m=[16], block_n=[64, 128], block_k=[128], split_k=[8], num_warps=[2, 4],
                       num_stages=[1, 3], kind=["gemv"])
    elif m <= 16:
        cands = _cfgs(block_m=[16], block_n=[32, 64, 128], block_k=bks, split_k=[1, 2, 4, 8], num_warps=[4],
                      num_stages=[3])
    elif m <= 64:
        cands = _cfgs(block_m=[32, 64], block_n=[64, 128], block_k=[64], split_k=[1, 2, 4, 8], num_warps=[4],
                      num_stages=[3])
    else:
        cands = _cfgs(block_m=[64, 128], block_n=[64, 128], block_k=[64], split_k=[1, 2], num_warps=[4, 8],
                      num_stages=[3])
        if not fp8:
            cands.append(MatmulConfig(128, 128, 64, num_warps=8, num_stages=3, kind="dequant"))
    if block_scales:  # tiles must lie inside one 128x128 scale block
        cands = [c for c in cands if 128 % c.block_k == 0 and 128 % c.block_n == 0]
    return cands


def decode_candidates(interpret: bool, fp8: bool) -> list[Any]:
    """The ``DecodeConfig``s tried for one cache mode, likeliest first (the sweep stops at its
    deadline): tile, warps, stages, partition, and for FP8 caches V staged as fp16 or not."""
    from qpage.kernels.configs import DecodeConfig

    v_f16 = (False, True) if fp8 else (False,)  # an fp16 cache's V needs no conversion
    if interpret:
        return [DecodeConfig(block_n=16, partition=32, v_f16=v) for v in v_f16]
    return [DecodeConfig(block_n=bn, num_warps=w, num_stages=st, partition=part, v_f16=v)
            for bn in (64, 128, 32) for w in (4, 8) for st in (2, 3) for part in (512, 1024, 256) for v in v_f16]


def _problems(interpret: bool) -> list[tuple[str, int, tuple[int, ...]]]:
    """(kind, M, shapes K x N flattened) in priority order."""
    shapes = ((256, 128),) if interpret else ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256))
    flat = tuple(v for s in shapes for v in s)
    order = [("int4-g128", 1), ("int4-g128", 16), ("int4-g128", 64), ("int4-g128", 256), ("fp8-chan", 1),
             ("fp8-chan", 16), ("int8-chan", 1), ("int4-g128", 4), ("fp8-chan", 64), ("fp8-chan", 256),
             ("int8-chan", 16), ("int8-chan", 64), ("fp8-block", 1), ("fp8-block", 16)]
    if interpret:
        order = [("int4-g128", 1), ("int4-g128", 16), ("fp8-chan", 1)]
    return [(kind, m, flat) for kind, m in order]


def _weights(kind: str, k: int, n: int, device: Any) -> tuple[dict[str, Any], Callable[..., Any], Callable[..., Any]]:
    """(params, fn(x, params, config), ref(x, params)) of one kind."""
    from kernel_common import make_fp8, make_int4, make_int8  # type: ignore[import-not-found]

    from qpage.kernels.fp8.matmul import fp8_matmul, fp8_matmul_ref
    from qpage.kernels.int_matmul import int_matmul
    from qpage.kernels.packing import int_matmul_ref

    if kind.startswith("fp8"):
        p = make_fp8(k, n, device, kind == "fp8-block")
        return (p, lambda x, q, c: fp8_matmul(x, q["weight"], q["scale"], c),
                lambda x, q: fp8_matmul_ref(x, q["weight"], q["scale"]))
    bits, group = (4, 128) if kind == "int4-g128" else (8, k)
    p = make_int4(k, n, 128, device) if bits == 4 else make_int8(k, n, device)

    def fn(x: Any, q: dict[str, Any], c: Any) -> Any:
        return int_matmul(x, q["qweight"], q["scales"], None, None, bits=bits, group_size=group, config=c)

    def ref(x: Any, q: dict[str, Any]) -> Any:
        return int_matmul_ref(x, q["qweight"], q["scales"], None, None, bits=bits, group_size=group)

    return p, fn, ref


def _best_config(fn: Callable[..., Any], x: Any, params: dict[str, Any], ref: Any, cands: list[Any],
                 timer: Any) -> tuple[Any, float, int]:
    """(best config, its seconds, candidates rejected for their output) for one problem."""
    from kernel_common import rel_err  # type: ignore[import-not-found]

    nbytes = sum(v.numel() * v.element_size() for v in params.values())
    copies = [params] + [{key: v.clone() for key, v in params.items()} for _ in range(timer.copies(nbytes) - 1)]
    best, best_t, rejected = None, float("inf"), 0
    for cfg in cands:
        try:
            if rel_err(fn(x, params, cfg), ref) > INT_TOL:
                rejected += 1
                continue
            t = timer.time([lambda p=p, c=cfg: fn(x, p, c) for p in copies], reps=10)
        except Exception:  # a configuration the compiler rejects (shared memory, registers)
            continue
        if t < best_t:
            best, best_t = cfg, t
    return best, best_t, rejected


def tune_matmuls(device: Any, timer: Any, deadline: float, interpret: bool, table: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    import torch

    from qpage.kernels.configs import default_matmul_config

    dtype = torch.float32 if interpret else torch.float16
    rows = []
    for kind, m, flat in _problems(interpret):
        shapes = list(zip(flat[::2], flat[1::2], strict=True))
        for k, n in shapes:
            if time.perf_counter() > deadline:
                rows.append(dict(kind=kind, M=m, K=k, N=n, skipped="budget"))
                continue
            params, fn, ref_fn = _weights(kind, k, n, device)
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = ref_fn(x, params)
            cands = matmul_candidates(m, interpret, kind.startswith("fp8"), kind == "fp8-block")
            # The built-in default, as the selectors pick it without a table (FP8: always tiled).
            if kind.startswith("fp8"):
                base = dataclasses.replace(default_matmul_config(m, n, k, x.device), kind="tiled")
            else:
                base = default_matmul_config(m, n, k, x.device, group_size=128 if kind == "int4-g128" else k)
            _, t_base, _ = _best_config(fn, x, params, ref, [base], timer)
            best, t_best, rejected = _best_config(fn, x, params, ref, cands, timer)
            w16 = torch.randn(n, k, device=device, dtype=dtype)
            t16 = timer.time([lambda: x @ w16.T], reps=10)
            row = dict(kind=kind, M=m, K=k, N=n, fp16_us=t16 * 1e6, heuristic_us=t_base * 1e6,
                       best_us=t_best * 1e6, rejected=rejected, best=dataclasses.asdict(best) if best else None)
            rows.append(row)
            # Under the interpreter times mean nothing (the sweep exercises the plumbing), so the
            # winner is kept even where the heuristic's run was faster by noise.
            if best is not None and (t_best < t_base or interpret):
                table["matmul"].setdefault(kind, {}).setdefault(f"{k}x{n}", {})[str(m)] = row["best"]
            print(f"  tune {kind:<9} M={m:>3} {k:>5}x{n:<6} fp16 {t16 * 1e6:7.1f} us  heuristic "
                  f"{t_base * 1e6:7.1f} us  best {t_best * 1e6:7.1f} us ({t16 / t_best:4.2f}x fp16)  "
                  f"rejected {rejected}  {row['best']}", flush=True)
    return rows


def tune_decode(device: Any, timer: Any, deadline: float, interpret: bool, table: dict[str, Any]
                ) -> list[dict[str, Any]]:
    import torch
    from kernel_common import fill_cache, rel_err  # type: ignore[import-not-found]

    from qpage.kernels.attention.decode import paged_attention_decode
    from qpage.kernels.attention.reference import paged_attention_decode_ref
    from qpage.kernels.configs import default_decode_config
    from qpage.kernels.tuned import decode_key

    dtype = torch.float32 if interpret else torch.float16
    nseq, ctx, heads, kvh, dim = (2, 80, 4, 2, 64) if interpret else (32, 4096, 32, 8, 128)
    q = torch.randn(nseq, heads, dim, device=device, dtype=dtype)
    lens = torch.full((nseq,), ctx, dtype=torch.int32, device=device)
    base = default_decode_config(device)
    rows = []
    for fmt, per_token in ((None, False), ("e4m3", True), ("e4m3", False)):
        if time.perf_counter() > deadline:
            break
        c = fill_cache(nseq, ctx, kvh, dim, dtype, fmt, per_token, device)
        kw = dict(k_scale=c["k_scale"], v_scale=c["v_scale"], fp8_format=fmt, max_seq_len=ctx)
        ref = paged_attention_decode_ref(q[:2], c["k_cache"], c["v_cache"], c["block_tables"][:2], lens[:2],
                                         dim**-0.5, c["k_scale"], c["v_scale"], fmt)

        def run(cfg: Any, c: dict[str, Any] = c, kw: dict[str, Any] = kw) -> Any:
            # The interpreter never splits a context by itself: force the candidate's partition
            # there, so that the split and its merge kernel run too.
            return paged_attention_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], lens, dim**-0.5,
                                          config=cfg, partition=cfg.partition if interpret else None, **kw)

        best, best_t = None, float("inf")
        t_base = timer.time([lambda: run(base)], reps=10)
        for cfg in decode_candidates(interpret, fmt is not None):
            if time.perf_counter() > deadline:
                break
            try:
                if rel_err(run(cfg)[:2], ref) > DECODE_TOL:
                    continue
                t = timer.time([lambda cfg=cfg: run(cfg)], reps=10)
            except Exception:  # a configuration the compiler rejects (shared memory, registers)
                continue
            if t < best_t:
                best, best_t = cfg, t
        key = decode_key(fmt, per_token, dim, heads // kvh)
        fields = dataclasses.asdict(best) if best is not None else None
        if fields is not None and (best_t < t_base or interpret):  # interpreter: as for the matmuls
            table["paged_decode"][key] = fields
        rows.append(dict(kind=f"paged decode {key}", heuristic_us=t_base * 1e6, best_us=best_t * 1e6, best=fields))
        print(f"  tune paged decode {key}: heuristic {t_base * 1e6:.1f} us, best {best_t * 1e6:.1f} us {fields}",
              flush=True)
    return rows


def tune(device: Any, device_label: str, timer: Any, budget_s: float, interpret: bool, out_dir: Path
         ) -> dict[str, Any]:
    """Run the sweep, write the table, install it in this process; returns the report."""
    import triton

    from qpage.kernels.tuned import device_key, install, problems

    deadline = time.perf_counter() + budget_s
    table: dict[str, Any] = dict(device=device_label, triton=triton.__version__, matmul={}, paged_decode={})
    rows = tune_decode(device, timer, time.perf_counter() + budget_s * 0.3, interpret, table)
    rows += tune_matmuls(device, timer, deadline, interpret, table)
    bad = problems(table)
    if bad:
        raise ValueError("the tuned table would not load: " + "; ".join(bad))
    path = out_dir / "configs" / f"{device_key(device_label)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)
    install(device, table)
    print(f"  wrote {path}", flush=True)
    return dict(table=table, rows=rows, path=str(path))
