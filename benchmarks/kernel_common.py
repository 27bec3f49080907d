"""Helpers shared by the GPU kernel benchmark scripts (``kernels.py``, ``kernels_attention.py``,
``kernel_tune.py``): the CUDA-graph timer, bandwidth figures, and random quantized weights and
paged caches in qpage's layouts."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

DATASHEET_GBS = {"H200": 4800.0, "H100": 3350.0, "4090": 1008.0, "3090": 936.0, "A100": 2039.0}


class Timer:
    """Median time per call of a function, replayed from a CUDA graph (or wall clock on CPU)."""

    def __init__(self, device: Any, l2_bytes: int) -> None:
        self.device = device
        self.l2_bytes = l2_bytes

    def copies(self, nbytes: int) -> int:
        """How many input copies make one graph replay read more than 4x the L2 cache."""
        if self.device.type != "cuda":
            return 1
        return max(1, min(64, math.ceil(4 * self.l2_bytes / max(nbytes, 1))))

    def time(self, calls: list[Callable[[], Any]], reps: int = 20) -> float:
        import torch

        if self.device.type != "cuda":
            t = time.perf_counter()
            for fn in calls:
                fn()
            return (time.perf_counter() - t) / len(calls)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:  # warm-up: compile and autotune outside the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / len(calls))
        del graph
        return sorted(times)[len(times) // 2]


def measure_copy_gbs(device: Any) -> float:
    """Device-to-device copy of 2 GiB of fp32, bytes read plus written per second."""
    import torch

    if device.type != "cuda":
        return float("nan")
    a = torch.randn(1 << 29, device=device)
    b = torch.empty_like(a)
    timer = Timer(device, 0)
    dt = timer.time([lambda: b.copy_(a)], reps=10)
    return 2 * a.numel() * 4 / dt / 1e9


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu"


def rel_err(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def make_int4(k: int, n: int, group: int, device: Any) -> dict[str, Any]:
    import torch

    g = math.ceil(k / group)
    return dict(
        qweight=torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device),
        scales=(torch.rand(g, n, device=device) * 0.01 + 0.001).half(),
    )


def make_awq4(k: int, n: int, group: int, device: Any) -> dict[str, Any]:
    """A random 4-bit AWQ-layout weight (packed along N; symmetric)."""
    import torch

    g = math.ceil(k / group)
    return dict(
        qweight=torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device=device),
        scales=(torch.rand(g, n, device=device) * 0.01 + 0.001).half(),
    )


def make_int8(k: int, n: int, device: Any) -> dict[str, Any]:
    import torch

    return dict(
        qweight=torch.randint(-(2**31), 2**31 - 1, (k // 4, n), dtype=torch.int32, device=device),
        scales=(torch.rand(1, n, device=device) * 0.01 + 0.001).half(),
    )


def make_fp8(k: int, n: int, device: Any, block: bool) -> dict[str, Any]:
    import torch

    w = (torch.randn(n, k, device=device) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(n / 128), math.ceil(k / 128), device=device) if block else torch.rand(n, device=device)
    return dict(weight=w, scale=scale * 0.001)


def fill_cache(num_seqs: int, ctx: int, kvh: int, dim: int, dtype: Any, fmt: str | None, per_token: bool,
               device: Any) -> dict[str, Any]:
    """A paged cache holding ``num_seqs`` random sequences of ``ctx`` tokens in shuffled blocks."""
    import torch

    from qpage.kernels.attention.cache_write import write_kv_cache
    from qpage.kernels.kv_quant import write_kv_cache_ref

    # Filling is setup, not what is measured: on CPU (interpreter) the torch writer is faster.
    writer = write_kv_cache if device.type == "cuda" else write_kv_cache_ref
    blocks_per_seq = math.ceil(ctx / 16)
    nb = num_seqs * blocks_per_seq
    cdt = torch.uint8 if fmt else dtype
    kc = torch.empty(nb, 16, kvh, dim, dtype=cdt, device=device)
    vc = torch.empty_like(kc)
    if fmt and per_token:
        ks = torch.empty(nb, 16, kvh, dtype=torch.float16, device=device)
        vs = torch.empty_like(ks)
    elif fmt:
        ks, vs = torch.tensor([0.01], device=device), torch.tensor([0.01], device=device)
    else:
        ks = vs = None
    bt = torch.randperm(nb, device=device).to(torch.int32).view(num_seqs, blocks_per_seq)
    for s in range(num_seqs):
        slots = (bt[s].long()[:, None] * 16 + torch.arange(16, device=device)).flatten()[:ctx]
        k = torch.randn(ctx, kvh, dim, device=device, dtype=dtype)
        writer(k, torch.randn_like(k), kc, vc, slots.to(torch.int32), ks, vs, fmt)
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, fp8_format=fmt, block_tables=bt)
