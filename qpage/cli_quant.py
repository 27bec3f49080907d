"""``qpage quantize``, ``qpage inspect`` and ``qpage eval`` (the offline commands)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from qpage.formats.gguf_write import FILE_TYPES
from qpage.formats.scheme import SCHEMES
from qpage.inspect_model import describe, eval_file, table


def add_parsers(sub: Any) -> None:
    q = sub.add_parser("quantize", help="quantize a checkpoint (GPTQ, AWQ, compressed-tensors, bitsandbytes or GGUF)")
    q.add_argument("src", help="source model folder (config.json + *.safetensors), a .gguf file (for --format gguf), "
                               "or 'default'")
    q.add_argument("out", help="output folder, or .gguf file for --format gguf (must not exist)")
    q.add_argument("--scheme", required=True, type=str.lower, choices=SCHEMES + tuple(FILE_TYPES),
                   help="integer, FP8 or NF4 scheme; with --format gguf a llama.cpp file type (q4_k_m, q4_0, ...)")
    q.add_argument("--group-size", type=int, default=128,
                   help="input features per group; 0 = per channel (nf4: always blocks of 64)")
    q.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric grid, or --no-sym for a zero point per group (default: --no-sym at 4 bits, "
                        "--sym at 8)")
    q.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    q.add_argument("--static-groups", action="store_true",
                   help="GPTQ act-order: keep groups in the original column order (no permuted g_idx; "
                        "always so for --format compressed-tensors)")
    q.add_argument("--gptq", action="store_true",
                   help="GGUF: GPTQ's error feedback inside the block formats (needs --calib). With --calib alone, "
                        "the block scales are weighted by the calibration inputs (llama.cpp's importance matrix)")
    q.add_argument("--calib", nargs="+", default=None, metavar="TEXT",
                   help="calibration text (imatrix, GPTQ, AWQ): a file, e.g. wikitext-2 valid.txt, or a built-in "
                        "(python-docs, python-source); several are mixed evenly")
    q.add_argument("--samples", type=int, default=128, help="calibration windows")
    q.add_argument("--shard-size", default="512MiB", help="output shard size (bounds the writer's buffer)")
    q.add_argument("--format", default="auto",
                   choices=("auto", "gptq", "awq", "compressed-tensors", "bitsandbytes", "gguf"),
                   help="output format; auto: GGUF for a llama.cpp file type, compressed-tensors for fp8, "
                        "bitsandbytes for nf4, AWQ GEMM for AWQ when the widths divide by the group (else GPTQ), "
                        "GPTQ otherwise. GGUF takes its scales from --calib's activations when given")
    q.add_argument("--eval-text", action="append", default=None,
                   help="text for the perplexity report (source vs result; saved with the checkpoint for "
                        "qpage inspect): a file, or python-docs (Python's own reference text, a held-out domain "
                        "for wikitext calibration); repeat for several")
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
    e.add_argument("--text", required=True, help="text file, or python-docs (Python's own reference text)")
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


def _perplexity(engines: list[Any], text: str, seq_len: int, windows: int, chunk: int) -> dict[str, Any]:
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


def _calibration(src: Path, args: argparse.Namespace) -> list[list[int]] | None:
    if not args.calib:
        return None
    from transformers import AutoTokenizer

    from qpage.eval.perplexity import mixed_windows

    tok = AutoTokenizer.from_pretrained(str(src))
    return mixed_windows(tok, args.calib, args.seq_len, args.samples)


def cmd_quantize(args: argparse.Namespace) -> int:
    from qpage.models.loader import resolve_hf_folder, resolve_model_dir

    gguf = args.format == "gguf" or (args.format == "auto" and args.scheme in FILE_TYPES)
    if gguf != (args.scheme in FILE_TYPES):
        raise ValueError(f"--scheme {args.scheme} with --format {args.format}: GGUF files take a llama.cpp file type "
                         f"({', '.join(FILE_TYPES)}), the other formats one of {', '.join(SCHEMES)}")
    model = None if args.src == "default" else args.src
    if gguf:
        from qpage.quantizers.gguf_pipeline import quantize_gguf

        if args.sym is not None or args.act_order or args.static_groups:
            raise ValueError("GGUF file types fix their own grids; drop --sym/--no-sym, --act-order and "
                             "--static-groups (pick another file type, e.g. q4_1 for an offset per block)")
        src = resolve_model_dir(model)  # the file itself when it is a GGUF; its weights as a folder to calibrate
        hf = resolve_hf_folder(model) if args.calib else None
        r = quantize_gguf(src, Path(args.out), args.scheme, calib=_calibration(hf, args) if hf else None,
                          calib_folder=hf, gptq=args.gptq)
    else:
        if args.gptq:
            raise ValueError("--gptq is for --format gguf; the other formats take --scheme int4-gptq or int8-gptq")
        from qpage.config import parse_size
        from qpage.formats.scheme import QuantScheme
        from qpage.quantizers.pipeline import quantize_checkpoint

        src = resolve_hf_folder(model)
        scheme = QuantScheme.parse(args.scheme, group_size=args.group_size or None, sym=args.sym,
                                   act_order=args.act_order, static_groups=args.static_groups)
        r = quantize_checkpoint(src, Path(args.out), scheme, calib=_calibration(src, args),
                                shard_bytes=parse_size(args.shard_size, "--shard-size"), fmt=args.format)
    print(f"qpage quantize: {r.scheme}, {r.linears} linears in {r.seconds:.1f}s; "
          f"{r.bytes_in / 1e6:.1f} MB -> {r.bytes_out / 1e6:.1f} MB on disk; peak RSS {r.peak_rss_bytes / 1e6:.0f} MB")
    if r.rtn_fallbacks:
        print(f"  {r.rtn_fallbacks} projections (experts few tokens were routed to) saw too few calibration rows "
              "and were rounded (RTN) instead")
    if args.eval_text:
        _report_quality(r.out, src, args.eval_text, args.seq_len, args.eval_windows)
    else:
        print("perplexity: skipped (give --eval-text FILE or --eval-text python-docs for the quality report)")
    return 0


def _report_quality(out: Path, src: Path, texts: list[str], seq_len: int, windows: int) -> None:
    """Score the result against its source on each text, print a line per text and save the
    figures beside the checkpoint (``eval_file``), where ``qpage inspect`` reads them."""
    from qpage.eval.texts import text_label

    engines = [_engine(str(out), seq_len), _engine(str(src), seq_len)]
    rows = []
    for text in texts:
        res = _perplexity(engines, text, seq_len, windows, seq_len)
        q, s = res["perplexity"]
        rows.append({"text": text_label(text), "windows": res["windows"], "seq_len": seq_len,
                     "perplexity": q, "source_perplexity": s, "mean_kl": res["mean_kl"]})
        print(f"perplexity on {res['windows']} x {seq_len} tokens of {text_label(text)}: source {s:.4f}, "
              f"quantized {q:.4f} ({100 * (q / s - 1):+.2f}%), mean KL {res['mean_kl']:.4f}")
    dest = eval_file(out)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_text(json.dumps({"source": str(src), "texts": rows}, indent=1))
    tmp.rename(dest)


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
