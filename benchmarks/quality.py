"""Quantization quality on the default model: perplexity and mean KL against fp32, size and
time of each qpage scheme, in domain and on a held-out domain.

Protocol: calibration windows of ``--seq-len`` tokens from wikitext-2 ``valid.txt``, or a mix
of texts (``--calib``, drawn evenly; imatrix, GPTQ, AWQ, SignRound); scored on the first ``--windows``
windows of wikitext-2 ``test.txt`` (in domain) and the first ``--heldout-windows`` of
``--heldout`` (default ``python-docs``, Python's own reference text: technical prose and code,
nothing like wikitext).
Every scheme is scored on the same windows in one run, next to the unquantized model (whose
log-probabilities are kept on disk as fp16 for the KL column), and next to the peer tools
that run here: GPTQModel 7.7 (quantizing on the same windows in its own process; its
checkpoint is scored by qpage's engine like every other row) and bitsandbytes NF4
(quantized at load by transformers, no calibration; scored by transformers on the wikitext
windows, next to transformers' score of the unquantized model, which must equal qpage's).

    python benchmarks/quality.py [--samples 32] [--seq-len 512] [--windows 40] [--heldout-windows 12]
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext2"
# (label, scheme, group size, act-order, symmetric)
SCHEMES = [
    ("int4-rtn g128 sym", "int4-rtn", 128, False, True),
    ("int4-rtn g128 asym", "int4-rtn", 128, False, False),
    ("int4-imatrix g128 asym", "int4-imatrix", 128, False, False),
    ("int4-gptq g128 asym", "int4-gptq", 128, False, False),
    ("int4-gptq g128 asym act-order", "int4-gptq", 128, True, False),
    ("int4-awq g128 asym", "int4-awq", 128, False, False),
    ("int4-signround g128 asym", "int4-signround", 128, False, False),
    ("int8-rtn channel", "int8-rtn", None, False, True),
    ("int8-rtn g128", "int8-rtn", 128, False, True),
    ("int8-rtn g32 (Q8_0's blocks)", "int8-rtn", 32, False, True),
    ("int8-rtn g32 asym", "int8-rtn", 32, False, False),
    ("int8-rtn g128 asym", "int8-rtn", 128, False, False),
    ("int8-rtn channel asym", "int8-rtn", None, False, False),
    ("int8-imatrix channel", "int8-imatrix", None, False, True),
    ("fp8 channel", "fp8", None, False, True),
    ("fp8 block 128x128", "fp8-block", None, False, True),
    ("nf4 (bitsandbytes format)", "nf4", None, False, True),
]
# Peer tools, run on the same calibration windows (label, extra arguments of the peer script).
PEERS = [("GPTQModel 7.7 int4 g128 (its defaults)", [])]


class Scorer:
    """Perplexity and mean KL(fp32 || model) of a model on fixed windows of each text; the
    reference's log-probabilities are kept in an fp16 file under ``work``."""

    def __init__(self, texts: dict[str, list[list[int]]], seq_len: int, work: Path) -> None:
        self.texts, self.seq_len, self.work = texts, seq_len, work
        self.ref: dict[str, np.ndarray] = {}

    def _engine(self, model: str | None, dequantize: bool) -> Any:
        from qpage import LLM

        return LLM(model=model, max_model_len=self.seq_len, kv_cache_memory="64MiB", enable_prefix_caching=False,
                   log_stats=False, dequantize_weights=dequantize).llm_engine

    def reference(self, model: str) -> dict[str, dict[str, float]]:
        """Score the reference and keep its log-probabilities."""
        return self.score(model, keep=True)

    def score(self, model: str, dequantize: bool = False, keep: bool = False) -> dict[str, dict[str, float]]:
        import torch

        from qpage.eval.perplexity import kl_rows, nll_sum, score_window

        eng = self._engine(model, dequantize)
        out = {}
        for label, wins in self.texts.items():
            rows = len(wins[0]) - 1
            nll, kl = 0.0, 0.0
            for i, ids in enumerate(wins):
                lp = score_window(eng, ids, self.seq_len)
                nll += nll_sum(lp, ids)
                if keep:
                    if i == 0:
                        self.ref[label] = np.lib.format.open_memmap(
                            self.work / f"ref-{label}.npy", mode="w+", dtype=np.float16, shape=(len(wins), *lp.shape))
                    self.ref[label][i] = lp.numpy()
                elif label in self.ref:
                    kl += float(kl_rows(torch.from_numpy(self.ref[label][i].astype(np.float32)), lp).sum())
            n = rows * len(wins)
            out[label] = {"perplexity": math.exp(nll / n), "mean_kl": None if keep else kl / n}
        return out


def fmt_scores(scores: dict[str, dict[str, float]], base: dict[str, dict[str, float]]) -> str:
    parts = []
    for label, v in scores.items():
        kl = f", KL {v['mean_kl']:.4f}" if v.get("mean_kl") is not None else ""
        parts.append(f"{label} {v['perplexity']:.4f} ({100 * (v['perplexity'] / base[label]['perplexity'] - 1):+.2f}%"
                     f"{kl})")
    return "; ".join(parts)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=40, help="wikitext-2 test.txt windows")
    p.add_argument("--heldout", default="python-docs", help="held-out text: a file or python-docs")
    p.add_argument("--heldout-windows", type=int, default=12)
    p.add_argument("--calib", nargs="+", default=None, metavar="TEXT",
                   help="calibration texts, mixed evenly (default: wikitext-2 valid.txt); e.g. valid.txt python-source")
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


def save(args: argparse.Namespace, rows: list[dict[str, Any]], texts: dict[str, list[list[int]]]) -> Path:
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(samples=args.samples, seq_len=args.seq_len, calibration=calib_label(args),
                                   windows={k: len(v) for k, v in texts.items()}, rows=rows), indent=1))
    tmp.replace(path)
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
    return [dict(scheme=f"{label} {res['version']}", scores={"wikitext": {"perplexity": p}},
                 size_bytes=res["memory_bytes"],
                 size_is_memory=True, quantize_seconds=res["quantize_seconds"], peer=True,
                 scorer_check_unquantized=res["unquantized_perplexity_transformers"])]


def run_peers(args: argparse.Namespace, src: Path, work: Path, scorer: Scorer, base: dict[str, Any]
              ) -> list[dict[str, Any]]:
    """Each peer quantizes in its own process on the same windows; qpage scores its checkpoint."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("gptqmodel") is None:
        print("GPTQModel is not installed: peer rows skipped (bash scripts/install_peers.sh installs it)",
              flush=True)
        return []
    if args.calib:
        print("peer rows skipped: the peer script calibrates on valid.txt only, not a --calib mix", flush=True)
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
        scores = scorer.score(str(out))
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        rows.append(dict(scheme=label, scores=scores, size_bytes=size, quantize_seconds=secs, peer=True))
        print(f"{label}: {fmt_scores(scores, base)}, {secs:.0f} s", flush=True)
        shutil.rmtree(out)
    return rows


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]], texts: dict[str, list[list[int]]]) -> None:
    base = rows[0]["scores"]
    print(f"\ncalibration {args.samples} x {args.seq_len} ({calib_label(args)}); scored on "
          + ", ".join(f"{len(v)} x {args.seq_len} of {k}" for k, v in texts.items()))
    head = f"{'scheme':<34}"
    for k in texts:
        head += f" {k[:12]:>12} {'vs fp32':>8} {'KL':>7}"
    print(head + f" {'size MB':>8} {'time s':>7}")
    for r in rows:
        if "scores" not in r:
            print(f"{r['scheme']:<34} failed")
            continue
        line = f"{r['scheme'][:34]:<34}"
        for k in texts:
            v = r["scores"].get(k)
            if v is None:
                line += f" {'':>12} {'':>8} {'':>7}"
                continue
            kl = v.get("mean_kl")
            line += (f" {v['perplexity']:>12.4f} {100 * (v['perplexity'] / base[k]['perplexity'] - 1):>+7.2f}%"
                     f" {kl:>7.4f}" if kl is not None else
                     f" {v['perplexity']:>12.4f} {100 * (v['perplexity'] / base[k]['perplexity'] - 1):>+7.2f}%"
                     f" {'':>7}")
        print(line + f" {r['size_bytes'] / 1e6:>8.1f} {r.get('quantize_seconds', 0):>7.0f}")


def calib_label(args: argparse.Namespace) -> str:
    from qpage.eval.texts import text_label

    calib = getattr(args, "calib", None)
    return " + ".join(text_label(c) for c in calib) if calib else "wikitext-2 valid.txt"


def windows(src: Path, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """(calibration windows of ``valid.txt`` or the ``--calib`` mix, the scored windows of each
    text) as the arguments say."""
    from transformers import AutoTokenizer

    from qpage.eval.perplexity import mixed_windows, token_windows
    from qpage.eval.texts import text_label

    tok = AutoTokenizer.from_pretrained(str(src))
    data = Path(args.data)

    def take(text: str | Path, n: int) -> list[list[int]]:
        return token_windows(tok, text, args.seq_len, n, max_chars=200 * args.seq_len * n)

    heldout = getattr(args, "heldout", "python-docs")
    calib = getattr(args, "calib", None) or [data / "valid.txt"]
    return mixed_windows(tok, calib, args.seq_len, args.samples), {"wikitext": take(data / "test.txt", args.windows),
                                                     text_label(heldout): take(heldout, args.heldout_windows)}


def main() -> None:
    args = parse_args()

    from qpage.formats.gguf import default_model_dir
    from qpage.formats.scheme import CALIBRATED, QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    src = default_model_dir()
    calib, texts = windows(src, args)
    work = Path(tempfile.mkdtemp(prefix="qpage-quality-"))
    try:
        scorer = Scorer(texts, args.seq_len, work)
        base = scorer.reference(str(src))
        rows: list[dict[str, Any]] = [dict(scheme="unquantized (fp32)", scores=base,
                                           size_bytes=sum(f.stat().st_size for f in src.glob("*.safetensors")))]
        print(f"unquantized: {fmt_scores(base, base)}", flush=True)
        for label, name, group, act, sym in SCHEMES:
            if args.only_peers or (args.only and not any(o in label for o in args.only)):
                continue
            out = work / label.replace(" ", "_")
            t = time.perf_counter()
            scheme = QuantScheme.parse(name, group_size=group, sym=sym, act_order=act)
            r = quantize_checkpoint(src, out, scheme, progress=False,
                                    calib=calib if scheme.method in CALIBRATED else None)
            secs = time.perf_counter() - t
            scores = scorer.score(str(out))
            rows.append(dict(scheme=label, scores=scores, size_bytes=r.bytes_out, quantize_seconds=secs,
                             peak_rss_bytes=r.peak_rss_bytes))
            print(f"{label}: {fmt_scores(scores, base)}, {secs:.0f} s", flush=True)
            if args.also_dequantized:
                rows[-1]["scores_dequantized"] = scorer.score(str(out), dequantize=True)
                print(f"{label}, dequantized: {fmt_scores(rows[-1]['scores_dequantized'], base)}", flush=True)
            shutil.rmtree(out)
            save(args, rows, texts)  # after every row: a stopped run keeps what it measured
        if "bnb" in args.peers:
            rows += run_bnb(src, work, texts["wikitext"], base["wikitext"]["perplexity"])
            save(args, rows, texts)
        if "gptqmodel" in args.peers:
            rows += run_peers(args, src, work, scorer, base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = save(args, rows, texts)
    print_table(args, rows, texts)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
