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


def _decode_variants(q: Any, c: dict[str, Any], fmt: str | None, per_token: bool,
                     device: Any) -> list[tuple[str, dict[str, Any]]]:
    """The decode settings timed side by side with the default for one cache: per-token scales
    loaded within their own tile (before 2026-11-30's change), FP8 V converted row-wise (rows
    scaled) and staged as fp16, that at 8 warps with and without registers capped at 80 (3
    programs per SM instead of 2 on sm_90), the packed-PTX e4m3 decoder where the hardware
    conversion is the default (sm_89+: on the H200 it is the PTX's check against the
    reference), and paged_decode_t (tokens as the MMA's rows) with q K^T in FP8 (relerr against
    the reference on q as the kernel rounds it, hi + lo e4m3) or in fp16, each beside every
    load pipelined (loop_stages 3) and, on a GPU, no register cap."""
    import torch

    from qpage.kernels.fp8_codec import CVT_HW, fp8_decoder
    from qpage.kernels.paged_decode_t import decode_t_unfit, qk_fp8_unfit

    cuda = device.type == "cuda"
    t_fits = decode_t_unfit(q, c["k_cache"], fmt) is None
    t_extra = [(" all loads pipelined", {"loop_stages": 3})] + ([(" no register cap", {"maxnreg": 0})] if cuda else [])
    out: list[tuple[str, dict[str, Any]]] = []
    if per_token:
        out.append(("scales in-loop", {"scales_ahead": False}))
    if fmt == "e4m3":
        out += [("v staged fp16", {"v_f16": True}), ("v staged fp16 8 warps", {"v_f16": True, "num_warps": 8}),
                ("v staged fp16 8 warps maxnreg 80", {"v_f16": True, "num_warps": 8, "maxnreg": 80})]
        if fp8_decoder(device, fmt) == CVT_HW:
            out.append(("ptx decoder", {"decoder": "ptx"}))
    if t_fits and qk_fp8_unfit(q, fmt) is None:
        out += [(f"tokens-as-rows{name}", {"decode_t": True, "qk_fp8": True, **extra}) for name, extra in
                [("", {}), (" 128-token tiles", {"block_n": 128}), (" 16 query columns", {"q_pad": 16}), *t_extra]]
    if t_fits:
        out += [(f"tokens-as-rows q fp16{name}", {"decode_t": True, "qk_fp8": False, **extra})
                for name, extra in [("", {}), *t_extra]]
    if fmt and cuda:
        out.append(("bf16 model", {"q_dtype": torch.bfloat16}))
    if fmt == "e4m3" and cuda and t_fits:
        out.append(("tokens-as-rows bf16 model", {"decode_t": True, "q_dtype": torch.bfloat16}))
    return out


def _bench_decode(q: Any, c: dict[str, Any], kw: dict[str, Any], lens: Any, scale: float, label: str,
                  per_token: bool, device: Any, timer: Timer, sheet: float, peak: float) -> list[dict[str, Any]]:
    """The paged decode over one cache (``c``, settings ``kw``): the default, then each of
    ``_decode_variants``; GB/s counts the codes and the per-token scales."""
    from qpage.kernels.paged_attention import (
        LOG2E,
        decode_kernel_choice,
        paged_attention_decode,
        paged_attention_decode_ref,
    )
    from qpage.kernels.paged_decode_t import quantize_queries_ref

    nseq, ctx = lens.shape[0], int(lens[0])
    kvh, dim = c["k_cache"].shape[2], c["k_cache"].shape[3]
    fmt = kw["fp8_format"]
    ref_rows = slice(0, 2)

    def reference(qv: Any, settings: dict[str, Any]) -> Any:
        """The reference on q as the kernel multiplies it: paged_decode_t with qk_fp8 (its
        default) rounds q to two e4m3 parts, and its relerr is against that."""
        _, rounds = decode_kernel_choice(qv, c["k_cache"], fmt, None, settings.get("decode_t"),
                                         settings.get("qk_fp8"), per_token=per_token)
        qr = quantize_queries_ref(qv[ref_rows], scale * LOG2E).to(qv.dtype) if rounds else qv[ref_rows]
        return paged_attention_decode_ref(qr, c["k_cache"], c["v_cache"], c["block_tables"][ref_rows],
                                          lens[ref_rows], scale, **kw)

    out = paged_attention_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], lens, scale, **kw)
    err = rel_err(out[ref_rows], reference(q, {}))
    kv_bytes = 2 * nseq * ctx * kvh * dim * (1 if fmt else 2) + (2 * nseq * ctx * kvh * 2 if per_token else 0)
    t = timer.time([lambda: paged_attention_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], lens,
                                                   scale, max_seq_len=ctx, **kw)])
    rows = [dict(kernel=f"decode paged {label}", us=t * 1e6, gbs=kv_bytes / t / 1e9,
                 pct_measured_peak=100 * kv_bytes / t / 1e9 / peak,
                 pct_datasheet=100 * kv_bytes / t / 1e9 / sheet, relerr=err)]
    print(f"  decode paged {label}: {t * 1e6:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s, relerr {err:.1e}", flush=True)
    for vlabel, vkw in _decode_variants(q, c, fmt, per_token, device):
        name = f"decode paged {label} {vlabel}"
        try:
            vt, verr = _variant(vkw, q, c, kw, lens, scale, ctx, timer, reference, ref_rows)
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

    from qpage.kernels.fp8_codec import sm90_plus
    from qpage.kernels.paged_prefill import paged_attention_prefill, paged_attention_prefill_ref

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
