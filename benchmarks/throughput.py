"""Offline throughput: qpage vs transformers ``generate`` on the same workload.

Workload (fixed seed): N requests (default 64), prompt lengths uniform in [16, 512] and
output lengths uniform in [16, 256], prompts cut from wikitext-2 test text. qpage runs them
through continuous batching; transformers runs static batches of ``--batch-size``
(default: N) with left padding, each batch generating until its longest request is done
(the tokens counted are the requested ones). Also batch-1 decode tokens/s of both.

Each side runs in its own subprocess with the whole machine (same weights, fp32 activations,
same cores), one after the other: transformers the default model's weights as fp32
safetensors, qpage the shipped Q4_1 GGUF on its block kernels, or with ``--qpage-weights dense``
the same fp32 folder transformers runs (qpage's dense matmuls). Prints a table and writes JSON.

    python benchmarks/throughput.py [--requests 64] [--qpage-weights gguf|dense]
                                    [--out benchmarks/results/throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"


def workload(tokenizer: Any, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if DATA.is_file():
        ids = tokenizer.encode(DATA.read_text()[:400_000])
    else:  # no data folder: random ids from the vocabulary
        ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(100_000)]
    out = []
    for _ in range(n):
        plen, olen = rng.randint(16, 512), rng.randint(16, 256)
        start = rng.randrange(0, len(ids) - plen)
        out.append((ids[start : start + plen], olen))
    return out


def run_qpage(work: list[tuple[list[int], int]], args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    from qpage import LLM, SamplingParams

    model = str(model_dir) if args.qpage_weights == "dense" else None  # None: the default GGUF
    llm = LLM(model=model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.batch_size or len(work),
              max_num_batched_tokens=args.max_num_batched_tokens, log_stats=False)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    dt, n_out = float("nan"), 0
    if not args.b1_only:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(o for _, o in work)
    b1 = decode_b1(lambda k: llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=k,
                                                                    ignore_eos=True), use_tqdm=False),
                   args.b1_tokens)
    return {"seconds": dt, "output_tokens": n_out, "tokens_per_s": n_out / dt, "b1_decode_tokens_per_s": b1,
            "attention_backend": llm.llm_engine.runner.backend.name}


def run_hf(work: list[tuple[list[int], int]], args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bs = args.batch_size or len(work)
    pad = model.generation_config.pad_token_id or 0

    def batch_generate(batch: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)

    batch_generate(work[:2])  # warm-up
    dt, n_out = float("nan"), 0
    if not args.b1_only:
        t = time.perf_counter()
        for i in range(0, len(work), bs):
            batch_generate(work[i : i + bs])
        dt = time.perf_counter() - t
        n_out = sum(o for _, o in work)
    b1 = decode_b1(lambda k: batch_generate([(work[0][0], k)]), args.b1_tokens)
    return {"seconds": dt, "output_tokens": n_out, "tokens_per_s": n_out / dt, "b1_decode_tokens_per_s": b1}


def decode_b1(gen: Any, n: int = 128) -> float:
    """Decode tokens/s at batch 1: n / (best time for 1+n tokens - best time for 1 token), best of 3
    each (a difference of minima: one slow short run cannot make the difference negative)."""
    short, long = float("inf"), float("inf")
    for _ in range(3):
        t = time.perf_counter()
        gen(1)
        short = min(short, time.perf_counter() - t)
        t = time.perf_counter()
        gen(n + 1)
        long = min(long, time.perf_counter() - t)
    return n / (long - short) if long > short else float("nan")


def child(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from qpage.models.loader import resolve_hf_folder

    model_dir = resolve_hf_folder(None)  # transformers' copy: the default GGUF's weights, dequantized
    work = workload(AutoTokenizer.from_pretrained(model_dir), args.requests, args.seed)
    res = run_qpage(work, args, model_dir) if args.child == "qpage" else run_hf(work, args, model_dir)
    import torch

    res["torch_threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=0, help="static batch for transformers and "
                    "max_num_seqs for qpage (0: all requests at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    ap.add_argument("--qpage-weights", choices=["gguf", "dense"], default="gguf",
                    help="qpage runs the shipped Q4_1 GGUF (default) or the fp32 folder transformers runs")
    ap.add_argument("--b1-only", action="store_true", help="measure only batch-1 decode (about a minute)")
    ap.add_argument("--b1-tokens", type=int, default=128, help="tokens decoded for the batch-1 figure")
    ap.add_argument("--child", choices=["qpage", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, Any] = {"requests": args.requests, "seed": args.seed, "cpus": os.cpu_count(),
                               "qpage_weights": args.qpage_weights}
    for side in ("qpage", "hf"):
        cmd = [sys.executable, __file__, "--child", side, *sys.argv[1:]]
        print(f"running {side} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(line[len("RESULT "):])
    q, h = results["qpage"], results["hf"]
    results["throughput_ratio"] = q["tokens_per_s"] / h["tokens_per_s"]
    results["b1_decode_ratio"] = q["b1_decode_tokens_per_s"] / h["b1_decode_tokens_per_s"]
    print(f"\n{'':24}{'qpage':>12}{'transformers':>14}{'ratio':>8}")
    ratio = results["throughput_ratio"]
    print(f"{'workload tokens/s':24}{q['tokens_per_s']:12.1f}{h['tokens_per_s']:14.1f}{ratio:8.2f}")
    print(f"{'workload seconds':24}{q['seconds']:12.1f}{h['seconds']:14.1f}")
    print(f"{'batch-1 decode tokens/s':24}{q['b1_decode_tokens_per_s']:12.1f}"
          f"{h['b1_decode_tokens_per_s']:14.1f}{results['b1_decode_ratio']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
