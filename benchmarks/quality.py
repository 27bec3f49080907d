"""Quantization quality on the default model: perplexity, size and time of each qpage scheme.

Protocol: calibration windows of ``--seq-len`` tokens from wikitext-2
``valid.txt`` (GPTQ, AWQ), perplexity on the first ``--windows`` windows of ``test.txt``, every
scheme scored on the same windows in one run, next to the unquantized model, and next to
the peer tools that run here: GPTQModel 7.7 (quantizing on the same windows in its own
process; its checkpoint is scored by qpage's engine like every other row) and bitsandbytes
NF4 (quantized at load by transformers, no calibration; scored by transformers on the same
windows, next to transformers' score of the unquantized model, which must equal qpage's).

    python benchmarks/quality.py [--samples 128] [--seq-len 512] [--windows 40]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext2"
# (label, scheme, group size, act-order, symmetric)
SCHEMES = [
    ("int4-rtn g128", "int4-rtn", 128, False, True),
    ("int4-gptq g128 act-order", "int4-gptq", 128, True, True),
    ("int4-awq g128", "int4-awq", 128, False, True),
    ("int4-rtn g128 asym", "int4-rtn", 128, False, False),
    ("int4-gptq g128 asym act-order", "int4-gptq", 128, True, False),
    ("int4-awq g128 asym", "int4-awq", 128, False, False),
    ("int8-rtn channel", "int8-rtn", None, False, True),
    ("fp8 channel", "fp8", None, False, True),
    ("fp8 block 128x128", "fp8-block", None, False, True),
    ("nf4 (bitsandbytes format)", "nf4", None, False, True),
]
# Peer tools, run on the same calibration windows (label, extra arguments of the peer script).
PEERS = [("GPTQModel 7.7 int4 g128 (its defaults)", [])]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    p.add_argument("--only", nargs="*", default=None, help="run only the schemes whose label contains one of these")
    p.add_argument("--peers", nargs="*", default=["gptqmodel", "bnb"], choices=["gptqmodel", "bnb"],
                   help="peer tools to run (none: --peers with no names)")
    p.add_argument("--only-peers", action="store_true", help="only the unquantized row and the peer tools")
    p.add_argument("--also-dequantized", action="store_true",
                   help="score each qpage checkpoint again with its weights dequantized to fp32 (what the packed "
                        "CPU kernels cost in perplexity)")
    return p.parse_args()


def save(args: argparse.Namespace, rows: list[dict[str, Any]], windows: int) -> Path:
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(samples=args.samples, seq_len=args.seq_len, windows=windows, rows=rows), indent=1))
    return path


def run_bnb(src: Path, work: Path, test: list[list[int]], base: float) -> list[dict[str, Any]]:
    """bitsandbytes NF4 in its own process, scored by transformers on the same test windows."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("bitsandbytes") is None:
        print("bitsandbytes is not installed: NF4 row skipped (scripts/install_peers.sh)", flush=True)
        return []
    label = "bitsandbytes NF4 (transformers)"
    (work / "windows.json").write_text(json.dumps(test))
    cmd = [sys.executable, str(ROOT / "benchmarks/peers/bnb_nf4_eval.py"), str(src), str(work / "windows.json"),
           str(work / "bnb.json")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{label}: failed ({r.stderr.strip().splitlines()[-1:]})", flush=True)
        return [dict(scheme=label, error=r.stderr[-2000:])]
    res = json.loads((work / "bnb.json").read_text())
    p = res["perplexity"]
    print(f"{label} {res['version']}: {p:.4f} ({100 * (p / base - 1):+.2f}%); transformers scores the unquantized "
          f"model {res['unquantized_perplexity_transformers']:.4f} (qpage: {base:.4f})", flush=True)
    return [dict(scheme=f"{label} {res['version']}", perplexity=p, size_bytes=res["memory_bytes"],
                 size_is_memory=True, quantize_seconds=res["quantize_seconds"], peer=True,
                 scorer_check_unquantized=res["unquantized_perplexity_transformers"])]


def run_peers(args: argparse.Namespace, src: Path, work: Path, ppl: Any, base: float) -> list[dict[str, Any]]:
    """Each peer quantizes in its own process on the same windows; qpage scores its checkpoint."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("gptqmodel") is None:
        print("GPTQModel is not installed: peer rows skipped (bash scripts/install_peers.sh installs it)",
              flush=True)
        return []
    rows = []
    for label, extra in PEERS:
        out = work / "peer"
        cmd = [sys.executable, str(ROOT / "benchmarks/peers/gptqmodel_quantize.py"), str(src), str(out),
               "--calib", str(Path(args.data) / "valid.txt"), "--samples", str(args.samples),
               "--seq-len", str(args.seq_len), "--group-size", "128", *extra]
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        secs = time.perf_counter() - t
        if r.returncode != 0:
            print(f"{label}: failed ({r.stderr.strip().splitlines()[-1:]})", flush=True)
            rows.append(dict(scheme=label, error=r.stderr[-2000:]))
            continue
        p = ppl(str(out))
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        rows.append(dict(scheme=label, perplexity=p, size_bytes=size, quantize_seconds=secs, peer=True))
        print(f"{label}: {p:.4f} ({100 * (p / base - 1):+.2f}%), {secs:.0f} s", flush=True)
        shutil.rmtree(out)
    return rows


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]], windows: int) -> None:
    base = rows[0]["perplexity"]
    print(f"\ncalibration {args.samples} x {args.seq_len} (valid.txt); perplexity on {windows} x {args.seq_len} "
          "(test.txt)")
    print(f"{'scheme':<32} {'perplexity':>11} {'vs fp32':>8} {'size MB':>8} {'time s':>7} {'dequantized':>11}")
    for r in rows:
        if "perplexity" not in r:
            print(f"{r['scheme']:<32} failed")
            continue
        print(f"{r['scheme']:<32} {r['perplexity']:>11.4f} {100 * (r['perplexity'] / base - 1):>+7.2f}% "
              f"{r['size_bytes'] / 1e6:>8.1f} {r.get('quantize_seconds', 0):>7.0f}"
              + (f" {r['perplexity_dequantized']:>11.4f}" if "perplexity_dequantized" in r else ""))


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from qpage import LLM
    from qpage.eval.perplexity import nll_sum, score_window, token_windows
    from qpage.formats.gguf import default_model_dir
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    src = default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(src))
    data = Path(args.data)
    calib = token_windows(tok, data / "valid.txt", args.seq_len, args.samples,
                          max_chars=200 * args.seq_len * args.samples)
    test = token_windows(tok, data / "test.txt", args.seq_len, args.windows,
                         max_chars=200 * args.seq_len * args.windows)

    def ppl(model: str | None, dequantize: bool = False) -> float:
        eng = LLM(model=model, max_model_len=args.seq_len, kv_cache_memory="64MiB", enable_prefix_caching=False,
                  log_stats=False, dequantize_weights=dequantize).llm_engine
        nll = sum(nll_sum(score_window(eng, ids, args.seq_len), ids) for ids in test)
        return math.exp(nll / sum(len(ids) - 1 for ids in test))

    rows: list[dict[str, Any]] = [dict(scheme="unquantized (fp32)", perplexity=ppl(str(src)),
                                       size_bytes=sum(f.stat().st_size for f in src.glob("*.safetensors")))]
    print(f"unquantized: {rows[0]['perplexity']:.4f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="qpage-quality-"))
    try:
        for label, name, group, act, sym in SCHEMES:
            if args.only_peers or (args.only and not any(o in label for o in args.only)):
                continue
            out = work / label.replace(" ", "_")
            t = time.perf_counter()
            scheme = QuantScheme.parse(name, group_size=group, sym=sym, act_order=act)
            r = quantize_checkpoint(src, out, scheme, progress=False,
                                    calib=calib if scheme.method in ("gptq", "awq") else None)
            secs = time.perf_counter() - t
            p = ppl(str(out))
            rows.append(dict(scheme=label, perplexity=p, size_bytes=r.bytes_out, quantize_seconds=secs,
                             peak_rss_bytes=r.peak_rss_bytes))
            print(f"{label}: {p:.4f} ({100 * (p / rows[0]['perplexity'] - 1):+.2f}%), {secs:.0f} s", flush=True)
            if args.also_dequantized:
                rows[-1]["perplexity_dequantized"] = ppl(str(out), dequantize=True)
                print(f"{label}, dequantized: {rows[-1]['perplexity_dequantized']:.4f}", flush=True)
            shutil.rmtree(out)
            save(args, rows, len(test))  # after every row: a stopped run keeps what it measured
        if "bnb" in args.peers:
            rows += run_bnb(src, work, test, rows[0]["perplexity"])
            save(args, rows, len(test))
        if "gptqmodel" in args.peers:
            rows += run_peers(args, src, work, ppl, rows[0]["perplexity"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = save(args, rows, len(test))
    print_table(args, rows, len(test))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
