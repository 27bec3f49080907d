"""Paged attention and cache-write sections of ``kernels.py`` (decode and prefill against SDPA,
the FP8 cache write against torch's conversion)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from kernel_common import DATASHEET_GBS, Timer, device_name, fill_cache, rel_err


def _decode_variants(fmt: str | None, per_token: bool, default: Any, device: Any) -> list[tuple[str, dict[str, Any]]]:
    """The decode settings timed side by side with the default (``default``, the
    ``DecodeConfig`` this device runs for the cache mode): per-token scales loaded within their
    own tile instead of one tile ahead; for e4m3, FP8 V staged as fp16 flipped from the
    default (on by default on sm_90+) and 8 warps; on a GPU, a bf16 model's queries (FP8
    codes still multiplied in fp16). Each entry: ``DecodeConfig`` fields laid over the
    default, and ``q_dtype`` to cast the queries."""
    import torch

    out: list[tuple[str, dict[str, Any]]] = []
    if per_token:
        out.append(("scales in-loop", {"scales_ahead": False}))
    if fmt == "e4m3":
        out += [(f"v_f16={not default.v_f16}", {"v_f16": not default.v_f16}), ("8 warps", {"num_warps": 8})]
    if fmt and device.type == "cuda":
        out.append(("bf16 model", {"q_dtype": torch.bfloat16}))
    return out


def _bench_decode(q: Any, c: dict[str, Any], kw: dict[str, Any], lens: Any, scale: float, label: str,
                  per_token: bool, device: Any, timer: Timer, sheet: float, peak: float) -> list[dict[str, Any]]:
    """The paged decode over one cache (``c``, settings ``kw``): the default, then each of
    ``_decode_variants``; GB/s counts the codes and the per-token scales."""
    from qpage.kernels.attention.decode import decode_config, paged_attention_decode
    from qpage.kernels.attention.reference import paged_attention_decode_ref

    nseq, ctx = lens.shape[0], int(lens[0])
    kvh, dim = c["k_cache"].shape[2], c["k_cache"].shape[3]
    fmt = kw["fp8_format"]
    ref_rows = slice(0, 2)

    def run(qv: Any, config: Any = None) -> Any:
        return paged_attention_decode(qv, c["k_cache"], c["v_cache"], c["block_tables"], lens, scale,
                                      max_seq_len=ctx, config=config, **kw)

    def check_and_time(qv: Any, config: Any = None) -> tuple[float, float]:
        """(seconds per call, relerr against the reference on the first sequences)."""
        ref = paged_attention_decode_ref(qv[ref_rows], c["k_cache"], c["v_cache"], c["block_tables"][ref_rows],
                                         lens[ref_rows], scale, **kw)
        err = rel_err(run(qv, config)[ref_rows], ref)
        return timer.time([lambda: run(qv, config)]), err

    t, err = check_and_time(q)
    kv_bytes = 2 * nseq * ctx * kvh * dim * (1 if fmt else 2) + (2 * nseq * ctx * kvh * 2 if per_token else 0)
    rows = [dict(kernel=f"decode paged {label}", us=t * 1e6, gbs=kv_bytes / t / 1e9,
                 pct_measured_peak=100 * kv_bytes / t / 1e9 / peak,
                 pct_datasheet=100 * kv_bytes / t / 1e9 / sheet, relerr=err)]
    print(f"  decode paged {label}: {t * 1e6:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s, relerr {err:.1e}", flush=True)
    default = decode_config(q, c["k_cache"], fmt, per_token)
    for vlabel, vkw in _decode_variants(fmt, per_token, default, device):
        name = f"decode paged {label} {vlabel}"
        fields = {k: v for k, v in vkw.items() if k != "q_dtype"}
        try:
            vt, verr = check_and_time(q.to(vkw.get("q_dtype", q.dtype)), replace(default, **fields))
        except Exception as e:  # one variant failing (e.g. this Triton cannot compile it) keeps the rest
            rows.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"  {name}: failed: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        rows.append(dict(kernel=name, us=vt * 1e6, gbs=kv_bytes / vt / 1e9,
                         pct_datasheet=100 * kv_bytes / vt / 1e9 / sheet, relerr=verr))
        print(f"  {name}: {vt * 1e6:.1f} us, {kv_bytes / vt / 1e9:.0f} GB/s, relerr {verr:.1e}", flush=True)
    return rows


def _bench_prefill(c: dict[str, Any], kw: dict[str, Any], lens: Any, heads: int, scale: float, label: str,
                   per_token: bool, device: Any, dtype: Any, timer: Timer) -> list[dict[str, Any]]:
    """One sequence's last chunk (2048 new tokens on a GPU, 20 on CPU) over its whole context,
    and with per-token scales, ``scale_rows`` flipped from this GPU's default beside it."""
    import torch

    from qpage.kernels.attention.prefill import paged_attention_prefill
    from qpage.kernels.attention.reference import paged_attention_prefill_ref
    from qpage.kernels.configs import sm90_plus

    ctx, dim = int(lens[0]), c["k_cache"].shape[3]
    qlen = 2048 if device.type == "cuda" else 20
    qp = torch.randn(qlen, heads, dim, device=device, dtype=dtype)
    cu = torch.tensor([0, qlen], dtype=torch.int32, device=device)
    ctx1, bt1 = lens[:1], c["block_tables"][:1]
    nref = min(64, qlen)
    pref = paged_attention_prefill_ref(qp[:nref], c["k_cache"], c["v_cache"], bt1, cu.clamp_max(nref),
                                       ctx1 - qlen + nref, scale, **kw)
    flops = 4 * heads * dim * qlen * (ctx - qlen / 2)
    rows = []
    for suffix, extra in [("", {})] + ([(f" scale_rows={not sm90_plus(device)}",
                                         {"scale_rows": not sm90_plus(device)})] if per_token else []):
        pout = paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1, qlen, scale, **kw, **extra)
        t = timer.time([lambda extra=extra: paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1,
                                                                    qlen, scale, **kw, **extra)])
        name = f"prefill paged {label}" + (suffix or f" ({qlen} new / {ctx} ctx)")
        rows.append(dict(kernel=name, us=t * 1e6, tflops=flops / t / 1e12, relerr=rel_err(pout[:nref], pref)))
    return rows


def bench_attention(args: argparse.Namespace, device: Any, timer: Timer, peak: float) -> list[dict[str, Any]]:
    """Decode over 32 sequences x 4096 tokens (Llama-3-8B heads) and a 2048-token prefill chunk,
    for the fp16 cache and each FP8 mode, beside SDPA over contiguous fp16 K/V."""
    import torch
    import torch.nn.functional as F

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    nseq, ctx, heads, kvh, dim = (32, 4096, 32, 8, 128) if not args.interpret else (3, 100, 4, 2, 64)
    scale = dim**-0.5
    q = torch.randn(nseq, heads, dim, device=device, dtype=dtype)
    lens = torch.full((nseq,), ctx, dtype=torch.int32, device=device)
    # SDPA over contiguous fp16 K/V (no paging): the FP16 reference point.
    kd = torch.randn(nseq, kvh, ctx, dim, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    t_sdpa = timer.time([lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale,
                                                                 enable_gqa=True)])
    sdpa_bytes = 2 * kd.numel() * kd.element_size()
    rows = [dict(kernel="decode sdpa fp16 (contiguous)", us=t_sdpa * 1e6, gbs=sdpa_bytes / t_sdpa / 1e9)]
    # The bandwidth to compare against: the best of the copy and SDPA's read rate (both measured
    # here), and the datasheet figure.
    peak = max(peak if peak == peak else 0.0, sdpa_bytes / t_sdpa / 1e9)
    sheet = next((v for key, v in DATASHEET_GBS.items() if key in str(device_name(device))), float("nan"))
    for label, fmt, per_token in (("fp16", None, False), ("fp8 e4m3 per-token", "e4m3", True),
                                  ("fp8 e4m3 per-tensor", "e4m3", False), ("fp8 e5m2 per-token", "e5m2", True)):
        c = fill_cache(nseq, ctx, kvh, dim, dtype, fmt, per_token, device)
        kw = dict(k_scale=c["k_scale"], v_scale=c["v_scale"], fp8_format=fmt)
        rows += _bench_decode(q, c, kw, lens, scale, label, per_token, device, timer, sheet, peak)
        rows += _bench_prefill(c, kw, lens, heads, scale, label, per_token, device, dtype, timer)
    # SDPA causal prefill on contiguous fp16 for the same problem.
    qlen = 2048 if device.type == "cuda" else 20
    qs = torch.randn(1, heads, qlen, dim, device=device, dtype=dtype)
    ks = torch.randn(1, kvh, ctx, dim, device=device, dtype=dtype)
    mask = torch.ones(qlen, ctx, dtype=torch.bool, device=device).tril(ctx - qlen)
    t = timer.time([lambda: F.scaled_dot_product_attention(qs, ks, ks, attn_mask=mask, scale=scale, enable_gqa=True)])
    rows.append(dict(kernel=f"prefill sdpa fp16 masked ({qlen} new / {ctx} ctx)", us=t * 1e6,
                     tflops=4 * heads * dim * qlen * (ctx - qlen / 2) / t / 1e12))
    return rows


def bench_cache_write(args: argparse.Namespace, device: Any, timer: Timer) -> list[dict[str, Any]]:
    import torch

    from qpage.kernels.attention.cache_write import write_kv_cache
    from qpage.kernels.kv_quant import write_kv_cache_ref

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    tokens, kvh, dim = (4096, 8, 128) if not args.interpret else (12, 2, 64)
    nb = 2 * tokens // 16
    rows = []
    for fmt in ("e4m3", "e5m2"):
        k = torch.randn(tokens, kvh, dim, device=device, dtype=dtype) * 3
        v = torch.randn_like(k)
        slots = torch.randperm(nb * 16, device=device)[:tokens].to(torch.int32)
        caches = []
        for fn in (write_kv_cache, write_kv_cache_ref):
            kc = torch.zeros(nb, 16, kvh, dim, dtype=torch.uint8, device=device)
            vc = torch.zeros_like(kc)
            ks = torch.zeros(nb, 16, kvh, dtype=torch.float16, device=device)
            vs = torch.zeros_like(ks)
            fn(k, v, kc, vc, slots, ks, vs, fmt)
            caches.append((kc, vc, ks, vs))
        exact = all(torch.equal(a, b) for a, b in zip(*caches, strict=False))
        kc, vc, ks, vs = caches[0]
        t = timer.time([lambda: write_kv_cache(k, v, kc, vc, slots, ks, vs, fmt)])
        nbytes = 2 * k.numel() * (k.element_size() + 1) + 2 * tokens * kvh * 2
        rows.append(dict(kernel=f"cache write fp8 {fmt} per-token ({tokens} tokens)", us=t * 1e6,
                         gbs=nbytes / t / 1e9, bit_exact=exact))
        print(f"  cache write {fmt}: {t * 1e6:.1f} us, bit-exact vs torch: {exact}", flush=True)
    return rows
