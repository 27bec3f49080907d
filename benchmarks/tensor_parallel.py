"""Tensor parallelism on this machine: one process with all the cores against N ranks with
an equal share each (on CPU: one thread per rank on a 2-core machine), same checkpoint, same
requests, alternating rounds, each configuration in its own process.

Measures: batch-1 decode tokens/s (128 tokens after a 64-token prompt), a batch of 8 decoding
together (tokens/s), prefill of a 512-token prompt (tokens/s), and with N ranks the time rank 0
spends in collectives per decode step (all-reduces, the embedding's and the logits' gather).
Checkpoints: the default model's float32 weights, and an INT4 g128 GPTQ (RTN) checkpoint of it,
written once to the output folder.

    python benchmarks/tensor_parallel.py [--tp 2] [--rounds 3] [--out benchmarks/results/tensor_parallel.json]
    (on a CUDA machine: --device cuda)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, tp: int, device: str) -> dict[str, Any]:
    """One configuration, in this process: the three measures and the collectives' time."""
    from qpage import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=tp, device=device, kv_cache_memory="256MiB", log_stats=False,
              enable_prefix_caching=False)
    eng = llm.llm_engine
    comm = eng.workers.comm if eng.workers is not None else None
    words = ["the", "river", "runs", "past", "the", "mill", "and", "the", "old", "stone", "bridge", "toward"]
    prompt = {"prompt_token_ids": eng.tokenizer.encode(" ".join(words * 8))[:64]}
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    out: dict[str, Any] = {}
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    c0 = comm.comm_seconds if comm else 0.0
    t = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    out["decode_b1_tok_s"] = 128 / (time.perf_counter() - t)
    out["comm_ms_per_step"] = 1000 * ((comm.comm_seconds - c0) if comm else 0.0) / 128
    batch = [{"prompt_token_ids": prompt["prompt_token_ids"][i:]} for i in range(8)]
    t = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    out["decode_b8_tok_s"] = 8 * 64 / (time.perf_counter() - t)
    long = {"prompt_token_ids": eng.tokenizer.encode(" ".join(words * 60))[:512]}
    t = time.perf_counter()
    llm.generate([long], SamplingParams(max_tokens=1), use_tqdm=False)
    out["prefill_512_tok_s"] = 512 / (time.perf_counter() - t)
    out["rank_weight_mib"] = [round(r.weight_bytes / 2**20, 1) for r in eng.rank_reports]
    eng.shutdown()
    return out


def int4_checkpoint(out_dir: Path) -> Path:
    """An RTN INT4 g128 GPTQ-format checkpoint of the default model (written once)."""
    path = out_dir / "int4-g128"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "qpage", "quantize", "default", str(path), "--scheme", "int4-rtn",
                        "--format", "gptq", "--group-size", "128"], check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "results" / "tp_models"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tensor_parallel.json"))
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one configuration, JSON on the last line
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.device)))
        return
    from qpage.models.loader import resolve_hf_folder

    models = {"dense fp32": str(resolve_hf_folder(None)), "int4 g128": str(int4_checkpoint(Path(args.work)))}
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        for name, path in models.items():
            for tp in (1, args.tp):
                proc = subprocess.run([sys.executable, __file__, "--one", path, str(tp), "--device", args.device],
                                      capture_output=True, text=True, check=False)
                if proc.returncode:
                    sys.exit(f"{name} tp={tp} failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                runs.setdefault(f"{name}|{tp}", []).append(res)
                print(f"round {rnd + 1}: {name} tp={tp}: {res}", flush=True)
    keys = ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_512_tok_s")
    table = []
    print(f"\nmedians of {args.rounds} rounds; ratio = tp={args.tp} / tp=1 (one process, all cores)\n")
    print(f"| model | measure | tp=1 | tp={args.tp} | ratio |")
    print("|---|---|---:|---:|---:|")
    for name in models:
        one, many = runs[f"{name}|1"], runs[f"{name}|{args.tp}"]
        for k in keys:
            a, b = statistics.median(r[k] for r in one), statistics.median(r[k] for r in many)
            table.append({"model": name, "measure": k, "tp1": a, f"tp{args.tp}": b, "ratio": b / a})
            print(f"| {name} | {k} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
        comm = statistics.median(r["comm_ms_per_step"] for r in many)
        print(f"| {name} | collectives per decode step (rank 0) | | {comm:.2f} ms | |")
        table.append({"model": name, "measure": "comm_ms_per_step", f"tp{args.tp}": comm})
    write_json({"tp": args.tp, "rounds": args.rounds, "device": args.device, "table": table, "runs": runs},
               args.out)


if __name__ == "__main__":
    main()
