"""``qpage quantize``, ``qpage inspect`` and ``qpage eval`` (the offline commands)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from qpage.formats.scheme import SCHEMES
from qpage.inspect_model import describe, table


def add_parsers(sub: Any) -> None:
    q = sub.add_parser("quantize", help="quantize a Hugging Face checkpoint (GPTQ, AWQ or compressed-tensors)")
    q.add_argument("src", help="source model folder (config.json + *.safetensors), or 'default'")
    q.add_argument("out", help="output folder (must not exist)")
    q.add_argument("--scheme", required=True, choices=SCHEMES)
    q.add_argument("--group-size", type=int, default=128,
                   help="input features per group; 0 = per channel (nf4: always blocks of 64)")
    q.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True, help="symmetric (default) or --no-sym")
    q.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    q.add_argument("--static-groups", action="store_true",
                   help="GPTQ act-order: keep groups in the original column order (no permuted g_idx; "
                        "always so for --format compressed-tensors)")
    q.add_argument("--calib", default=None, help="calibration text file (GPTQ, AWQ), e.g. wikitext-2 valid.txt")
    q.add_argument("--samples", type=int, default=128, help="calibration windows")
    q.add_argument("--shard-size", default="512MiB", help="output shard size (bounds the writer's buffer)")
    q.add_argument("--format", default="auto", choices=("auto", "gptq", "awq", "compressed-tensors", "bitsandbytes"),
                   help="output format; auto: compressed-tensors for fp8, bitsandbytes for nf4, AWQ GEMM for AWQ "
                        "when the widths divide by the group (else GPTQ), GPTQ otherwise")
    q.add_argument("--eval-text", default=None, help="text file for the perplexity report (source vs result)")
    q.add_argument("--eval-windows", type=int, default=4)
    q.add_argument("--seq-len", type=int, default=512)
    i = sub.add_parser("inspect", help="describe a checkpoint: format, scheme, bits per weight, size on disk and "
                                       "in memory here, and the kernel path of its layers")
    i.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: the default model)")
    i.add_argument("--json", action="store_true", help="print JSON instead of the table")
    i.add_argument("--no-load", dest="load", action="store_false",
                   help="read the files only (no memory or kernel-path rows)")
    i.add_argument("--device", default="cpu", help="device to load on for the memory and paths (default: cpu)")
    i.add_argument("--dtype", default="auto", help="activation dtype, as for generate (default: auto)")
    e = sub.add_parser("eval", help="perplexity (and KL against a reference model) on a text file")
    e.add_argument("model", nargs="?", default=None, help="model folder (default: the default model)")
    e.set_defaults(model=None)
    e.add_argument("--text", required=True)
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--windows", type=int, default=16)
    e.add_argument("--chunk", type=int, default=512, help="prefill chunk; smaller reads more context from the cache")
    e.add_argument("--kl-ref", default=None, help="reference model folder for the mean KL divergence")
    e.add_argument("--kv-cache-dtype", default="auto")
    e.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the evaluated model is split over")
    e.add_argument("--out", default=None, help="write the result as JSON here")


def _engine(model: str | None, seq_len: int, kv_cache_dtype: str = "auto", tp: int = 1) -> Any:
    from qpage import LLM

    return LLM(model=model, max_model_len=seq_len, kv_cache_memory=max(64 << 20, seq_len * 50_000),
               enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, log_stats=False,
               tensor_parallel_size=tp).llm_engine


def _perplexity(engines: list[Any], text: Path, seq_len: int, windows: int, chunk: int) -> dict[str, Any]:
    from qpage.eval.perplexity import kl_rows, nll_sum, score_window, token_windows

    wins = token_windows(engines[0].tokenizer, text, seq_len, windows, max_chars=200 * seq_len * windows)
    nll = [0.0] * len(engines)
    kl, n = 0.0, 0
    for ids in wins:
        lps = [score_window(e, ids, chunk) for e in engines]
        for i, lp in enumerate(lps):
            nll[i] += nll_sum(lp, ids)
        if len(lps) > 1:
            kl += float(kl_rows(lps[1], lps[0]).sum())
        n += len(ids) - 1
    return {"perplexity": [math.exp(v / n) for v in nll], "mean_kl": kl / n if len(engines) > 1 else None,
            "windows": len(wins), "tokens": n}


def cmd_quantize(args: argparse.Namespace) -> int:
    from qpage.formats.scheme import QuantScheme
    from qpage.models.loader import resolve_hf_folder
    from qpage.quantizers.pipeline import quantize_checkpoint

    scheme = QuantScheme.parse(args.scheme, group_size=args.group_size or None, sym=args.sym,
                               act_order=args.act_order, static_groups=args.static_groups)
    src = resolve_hf_folder(None if args.src == "default" else args.src)
    calib = None
    if args.calib:
        from transformers import AutoTokenizer

        from qpage.eval.perplexity import token_windows

        tok = AutoTokenizer.from_pretrained(str(src))
        calib = token_windows(tok, Path(args.calib), args.seq_len, args.samples,
                              max_chars=200 * args.seq_len * args.samples)
    from qpage.config import parse_size

    r = quantize_checkpoint(src, Path(args.out), scheme, calib=calib,
                            shard_bytes=parse_size(args.shard_size, "--shard-size"), fmt=args.format)
    print(f"qpage quantize: {r.scheme}, {r.linears} linears in {r.seconds:.1f}s; "
          f"{r.bytes_in / 1e6:.1f} MB -> {r.bytes_out / 1e6:.1f} MB on disk; peak RSS {r.peak_rss_bytes / 1e6:.0f} MB")
    if args.eval_text:
        res = _perplexity([_engine(str(r.out), args.seq_len), _engine(str(src), args.seq_len)], Path(args.eval_text),
                          args.seq_len, args.eval_windows, args.seq_len)
        q, s = res["perplexity"]
        print(f"perplexity on {res['windows']} x {args.seq_len} tokens of {args.eval_text}: source {s:.4f}, "
              f"quantized {q:.4f} ({100 * (q / s - 1):+.2f}%), mean KL {res['mean_kl']:.4f}")
    else:
        print("perplexity: skipped (give --eval-text FILE for the quality report)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    info = describe(args.model, args.load, args.device, args.dtype)
    print(json.dumps(info, indent=1) if args.json else table(info))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    engines = [_engine(args.model, args.seq_len, args.kv_cache_dtype, args.tensor_parallel_size)]
    if args.kl_ref:
        engines.append(_engine(args.kl_ref, args.seq_len))
    res = _perplexity(engines, Path(args.text), args.seq_len, args.windows, args.chunk)
    res.update(model=args.model or "default", text=args.text, seq_len=args.seq_len, seconds=time.perf_counter() - t0)
    line = (f"perplexity {res['perplexity'][0]:.4f} over {res['windows']} windows x {args.seq_len} "
            f"({res['tokens']} tokens)")
    if args.kl_ref:
        line += f"; reference {res['perplexity'][1]:.4f}; mean KL {res['mean_kl']:.5f}"
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def run(args: argparse.Namespace) -> int:
    cmd = {"quantize": cmd_quantize, "inspect": cmd_inspect, "eval": cmd_eval}[args.command]
    try:
        return cmd(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"qpage: error: {e}", file=sys.stderr)
        return 2
