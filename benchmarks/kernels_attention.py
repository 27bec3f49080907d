"""Paged attention and cache-write sections of ``kernels.py`` (decode and prefill against SDPA,
the FP8 cache write against torch's conversion)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from kernel_common import DATASHEET_GBS, Timer, device_name, fill_cache, rel_err


@contextlib.contextmanager
def forced_decoder(name: str | None) -> Iterator[None]:
    """``QPAGE_FP8_DECODER=name`` for the duration (nothing when None)."""
    old = os.environ.get("QPAGE_FP8_DECODER")
    if name:
        os.environ["QPAGE_FP8_DECODER"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("QPAGE_FP8_DECODER", None)
        else:
            os.environ["QPAGE_FP8_DECODER"] = old


def _variant(vkw: dict[str, Any], q: Any, c: dict[str, Any], kw: dict[str, Any], lens: Any, scale: float, ctx: int,
             timer: Timer, reference: Callable[[Any, dict[str, Any]], Any], ref_rows: slice) -> tuple[float, float]:
    """(seconds per call, relerr against ``reference``) of the decode with settings ``vkw`` on
    top of ``kw``; ``decoder`` forces an FP8 decoder, ``q_dtype`` casts the queries."""
    from qpage.kernels.paged_attention import paged_attention_decode

    with forced_decoder(vkw.get("decoder")):
        qv = q.to(vkw.get("q_dtype", q.dtype))  # a bf16 model's queries: FP8 codes still multiplied in fp16
        vkw = {k: v for k, v in vkw.items() if k not in ("decoder", "q_dtype")}
        vout = paged_attention_decode(qv, c["k_cache"], c["v_cache"], c["block_tables"], lens, scale, **kw, **vkw)
        verr = rel_err(vout[ref_rows], reference(qv, vkw))
        vt = timer.time([lambda: paged_attention_decode(
            qv, c["k_cache"], c["v_cache"], c["block_tables"], lens, scale, max_seq_len=ctx, **kw, **vkw)])
    return vt, verr


def bench_attention(args: argparse.Namespace, device: Any, timer: Timer, peak: float) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from qpage.kernels.fp8_codec import CVT_HW, fp8_decoder, sm90_plus
    from qpage.kernels.paged_attention import (
        LOG2E,
        decode_kernel_choice,
        paged_attention_decode,
        paged_attention_decode_ref,
    )
    from qpage.kernels.paged_decode_t import decode_t_unfit, qk_fp8_unfit, quantize_queries_ref
    from qpage.kernels.paged_prefill import paged_attention_prefill, paged_attention_prefill_ref

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    nseq, ctx, heads, kvh, dim = (32, 4096, 32, 8, 128) if not args.interpret else (3, 100, 4, 2, 64)
    scale = dim**-0.5
    rows = []
    q = torch.randn(nseq, heads, dim, device=device, dtype=dtype)
    lens = torch.full((nseq,), ctx, dtype=torch.int32, device=device)
    # SDPA over contiguous fp16 K/V (no paging): the FP16 reference point.
    kd = torch.randn(nseq, kvh, ctx, dim, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    t_sdpa = timer.time([lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale,
                                                                 enable_gqa=True)])
    sdpa_bytes = 2 * kd.numel() * kd.element_size()
    rows.append(dict(kernel="decode sdpa fp16 (contiguous)", us=t_sdpa * 1e6, gbs=sdpa_bytes / t_sdpa / 1e9))
    # The bandwidth to compare against: the best of the copy and SDPA's read rate (both measured
    # here), and the datasheet figure.
    peak = max(peak if peak == peak else 0.0, sdpa_bytes / t_sdpa / 1e9)
    sheet = next((v for key, v in DATASHEET_GBS.items() if key in str(device_name(device))), float("nan"))
    for label, fmt, per_token in (("fp16", None, False), ("fp8 e4m3 per-token", "e4m3", True),
                                  ("fp8 e4m3 per-tensor", "e4m3", False), ("fp8 e5m2 per-token", "e5m2", True)):
        c = fill_cache(nseq, ctx, kvh, dim, dtype, fmt, per_token, device)
        kw = dict(k_scale=c["k_scale"], v_scale=c["v_scale"], fp8_format=fmt)
        out = paged_attention_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], lens, scale, **kw)
        ref_rows = slice(0, 2)

        def reference(qv: Any, settings: dict[str, Any], c: dict[str, Any] = c, kw: dict[str, Any] = kw,
                      per_token: bool = per_token) -> Any:
            """The reference on q as the kernel multiplies it: paged_decode_t with qk_fp8 (its
            default) rounds q to two e4m3 parts, and its relerr is against that."""
            _, rounds = decode_kernel_choice(qv, c["k_cache"], kw["fp8_format"], None, settings.get("decode_t"),
                                             settings.get("qk_fp8"), per_token=per_token)
            qr = quantize_queries_ref(qv[ref_rows], scale * LOG2E).to(qv.dtype) if rounds else qv[ref_rows]
            return paged_attention_decode_ref(qr, c["k_cache"], c["v_cache"], c["block_tables"][ref_rows],
                                              lens[ref_rows], scale, **kw)

        ref = reference(q, {})
        err = rel_err(out[ref_rows], ref)
        elem = 1 if fmt else 2
        kv_bytes = 2 * nseq * ctx * kvh * dim * elem + (2 * nseq * ctx * kvh * 2 if per_token else 0)
        t = timer.time([lambda: paged_attention_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], lens,
                                                       scale, max_seq_len=ctx, **kw)])
        rows.append(dict(kernel=f"decode paged {label}", us=t * 1e6, gbs=kv_bytes / t / 1e9,
                         pct_measured_peak=100 * kv_bytes / t / 1e9 / peak,
                         pct_datasheet=100 * kv_bytes / t / 1e9 / sheet, relerr=err))
        print(f"  decode paged {label}: {t * 1e6:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s, relerr {err:.1e}",
              flush=True)
        # Side by side: per-token scales loaded within their own tile (before 2026-11-30's
        # change), FP8 V converted row-wise (rows scaled) and staged as fp16, and that at 8 warps
        # with and without registers capped at 80 (3 programs per SM instead of 2 on sm_90).
        # The e4m3 "ptx decoder" row runs fp8_codec's packed PTX where the hardware conversion is
        # the default (sm_89+): on the H200 it is the PTX's check against the reference.
        t_extra = [(" all loads pipelined", {"loop_stages": 3})] + (
            [(" no register cap", {"maxnreg": 0})] if device.type == "cuda" else [])
        variants = ([("scales in-loop", {"scales_ahead": False})] if per_token else []) + (
            [("v staged fp16", {"v_f16": True}), ("v staged fp16 8 warps", {"v_f16": True, "num_warps": 8}),
             ("v staged fp16 8 warps maxnreg 80", {"v_f16": True, "num_warps": 8, "maxnreg": 80})]
            if fmt == "e4m3" else []) + (
            [("ptx decoder", {"decoder": "ptx"})] if fmt == "e4m3" and fp8_decoder(device, fmt) == CVT_HW else []) + (
            # paged_decode_t (tokens as the MMA's rows). With qk_fp8 (its default) relerr is
            # against the reference on q as the kernel rounds it (hi + lo e4m3). Beside each
            # query form: every load pipelined (loop_stages 3) and, on a GPU, no register cap.
            [(f"tokens-as-rows{name}", {"decode_t": True, "qk_fp8": True, **extra}) for name, extra in
             [("", {}), (" 128-token tiles", {"block_n": 128}), (" 16 query columns", {"q_pad": 16}), *t_extra]]
            if decode_t_unfit(q, c["k_cache"], fmt) is None and qk_fp8_unfit(q, fmt) is None else []) + (
            [(f"tokens-as-rows q fp16{name}", {"decode_t": True, "qk_fp8": False, **extra})
             for name, extra in [("", {}), *t_extra]]
            if decode_t_unfit(q, c["k_cache"], fmt) is None else []) + (
            [("bf16 model", {"q_dtype": torch.bfloat16})] if fmt and device.type == "cuda" else []) + (
            [("tokens-as-rows bf16 model", {"decode_t": True, "q_dtype": torch.bfloat16})]
            if fmt == "e4m3" and device.type == "cuda" and decode_t_unfit(q, c["k_cache"], fmt) is None else [])
        for vlabel, vkw in variants:
            try:
                vt, verr = _variant(vkw, q, c, kw, lens, scale, ctx, timer, reference, ref_rows)
            except Exception as e:  # one variant failing (e.g. this Triton cannot compile it) keeps the rest
                rows.append(dict(kernel=f"decode paged {label} {vlabel}", error=f"{type(e).__name__}: {e}"[:300]))
                print(f"  decode paged {label} {vlabel}: failed: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            rows.append(dict(kernel=f"decode paged {label} {vlabel}", us=vt * 1e6, gbs=kv_bytes / vt / 1e9,
                             pct_datasheet=100 * kv_bytes / vt / 1e9 / sheet, relerr=verr))
            print(f"  decode paged {label} {vlabel}: {vt * 1e6:.1f} us, {kv_bytes / vt / 1e9:.0f} GB/s, "
                  f"relerr {verr:.1e}", flush=True)
        # Prefill: one sequence's last chunk of 512 (or 2048) tokens over its whole context.
        qlen = 2048 if device.type == "cuda" else 20
        qp = torch.randn(qlen, heads, dim, device=device, dtype=dtype)
        cu = torch.tensor([0, qlen], dtype=torch.int32, device=device)
        ctx1 = lens[:1]
        bt1 = c["block_tables"][:1]
        pout = paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1, qlen, scale, **kw)
        nref = min(64, qlen)
        pref = paged_attention_prefill_ref(qp[:nref], c["k_cache"], c["v_cache"], bt1, cu.clamp_max(nref),
                                           ctx1 - qlen + nref, scale, **kw)
        perr = rel_err(pout[:nref], pref)
        t = timer.time([lambda: paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1, qlen, scale,
                                                        **kw)])
        flops = 4 * heads * dim * qlen * (ctx - qlen / 2)
        rows.append(dict(kernel=f"prefill paged {label} ({qlen} new / {ctx} ctx)", us=t * 1e6, tflops=flops / t / 1e12,
                         relerr=perr))
        if per_token:  # side by side: the per-token scales on the K/V rows (default on sm_90) or not
            alt = not sm90_plus(device)
            aout = paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1, qlen, scale, scale_rows=alt,
                                           **kw)
            at = timer.time([lambda: paged_attention_prefill(qp, c["k_cache"], c["v_cache"], bt1, cu, ctx1, qlen,
                                                             scale, scale_rows=alt, **kw)])
            rows.append(dict(kernel=f"prefill paged {label} scale_rows={alt}", us=at * 1e6, tflops=flops / at / 1e12,
                             relerr=rel_err(aout[:nref], pref)))
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

    from qpage.kernels.cache_write import write_kv_cache, write_kv_cache_ref

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
