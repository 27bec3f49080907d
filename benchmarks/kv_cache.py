"""KV cache quality and size: perplexity, KL divergence and bytes per token of each cache mode.

Modes: ``auto`` (the model dtype: fp32 on CPU), ``fp8_e4m3`` with per-token scales
(qpage's default FP8), ``fp8_e4m3`` with one per-tensor scale (vLLM style: the checkpoint's
``k_scale``/``v_scale``, 1.0 when it has none, as here), ``fp8_e5m2`` with per-token scales,
``fp8_e5m2`` per-tensor, ``int8`` / ``int4`` with and without the Hadamard rotation, and
``k8v4`` (int8 keys, int4 values).

Method: the default model (its fp32 folder) scores non-overlapping windows of ``--window`` tokens from
wikitext-2 ``test.txt``, teacher-forced, with chunked prefill of ``--chunk`` tokens: every
chunk after the first reads its context back from the (quantized) paged cache. Per
window, every mode scores the same tokens; perplexity is exp(mean NLL) over all scored
positions, and KL is the mean over positions of KL(auto || mode) of the full next-token
distributions. The top-2 gap shift says how far a mode moves greedy decisions: at each
position, the gap between the logprobs of the ``auto`` cache's two best tokens, and how much
the mode changes it (mean, 99th percentile, largest); greedy outputs can part wherever
``auto``'s gap is smaller than that. Bytes per token count K and V of all layers plus the scales (and zeros), and are
compared with an fp16 cache's (the usual GPU baseline) and the ``auto`` cache's.

    python benchmarks/kv_cache.py [--windows 16] [--window 512] [--chunk 128]
    python benchmarks/kv_cache.py --speed [--context 512 2048] [--tokens 64] [--rounds 3]   # decode tokens/s

``--speed``: greedy decode of ``--tokens`` tokens after a prompt of ``--context`` tokens
(default 512 and 2048; the prompts share it, so it is prefilled once), at batch 1 and batch 8,
for the fp32, FP8 per-token, int8, k8v4 and int4 caches on their default backend
(``cpu-native`` on CPU), plus, at the shortest context, the FP8 per-token cache on
``cpu-blas`` (the path without the C cache kernels). All engines are loaded first; each of
``--rounds`` rounds then times every mode once, in turn, and the medians are reported.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"
MODES: list[tuple[str, dict[str, Any]]] = [
    ("auto", dict(kv_cache_dtype="auto")),
    ("fp8_e4m3 per-token", dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="per_token")),
    ("fp8_e4m3 per-tensor", dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="per_tensor")),
    ("fp8_e5m2 per-token", dict(kv_cache_dtype="fp8_e5m2", kv_cache_scales="per_token")),
    ("fp8_e5m2 per-tensor", dict(kv_cache_dtype="fp8_e5m2", kv_cache_scales="per_tensor")),
    ("int8 rotated", dict(kv_cache_dtype="int8")),
    ("int8 not rotated", dict(kv_cache_dtype="int8", kv_cache_rotation=False)),
    ("k8v4 rotated", dict(kv_cache_dtype="k8v4")),
    ("int4 rotated", dict(kv_cache_dtype="int4")),
    ("int4 not rotated", dict(kv_cache_dtype="int4", kv_cache_rotation=False)),
]
SPEED_MODES = ("auto", "fp8_e4m3 per-token", "int8 rotated", "k8v4 rotated", "int4 rotated")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model folder (default: quality on the default model's fp32 folder, speed on its GGUF)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--windows", type=int, default=16, help="number of windows scored (from the start of the file)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk: context beyond it comes from the cache")
    p.add_argument("--out", default=None, help="default: benchmarks/results/kv_cache.json (kv_cache_speed.json)")
    p.add_argument("--speed", action="store_true", help="measure decode speed per mode instead of quality")
    p.add_argument("--tokens", type=int, default=64, help="--speed: tokens generated per request")
    p.add_argument("--rounds", type=int, default=3, help="--speed: rounds; each times every mode once")
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048],
                   help="--speed: prompt lengths in tokens (taken from --data)")
    return p.parse_args()


def speed(args: argparse.Namespace) -> None:
    """Decode tokens/s per mode and context length (module docstring)."""
    from qpage import LLM, SamplingParams

    p = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    text = Path(args.data).read_text(encoding="utf-8")[: 20 * max(args.context)]
    rows = []
    for ctx in args.context:
        runs = [(label, kw, "auto") for label, kw in MODES if label in SPEED_MODES]
        if ctx == min(args.context):  # the torch path is slow: compared at the shortest context only
            runs.append((*MODES[1], "cpu-blas"))
        engines, prompts = [], []
        for _, kwargs, backend in runs:
            llm = LLM(model=args.model, attention_backend=backend, log_stats=False, **kwargs)
            ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[: ctx - 1]
            if len(ids) < ctx - 1:
                raise SystemExit(f"{args.data}: fewer than {ctx} tokens for --context {ctx}")
            # One shared context (a prefix hit after the warm-up), a different last token each.
            prompts = [{"prompt_token_ids": [*ids, 100 + i]} for i in range(8)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up, prefill
            engines.append(llm)
        b1: list[list[float]] = [[] for _ in runs]
        b8: list[list[float]] = [[] for _ in runs]
        for _ in range(args.rounds):  # each round times every mode once, so the noise falls on all alike
            for i, llm in enumerate(engines):
                t = time.perf_counter()
                llm.generate(prompts[:1], p, use_tqdm=False)
                b1[i].append(args.tokens / (time.perf_counter() - t))
                t = time.perf_counter()
                llm.generate(prompts, p, use_tqdm=False)
                b8[i].append(8 * args.tokens / (time.perf_counter() - t))
        for (label, _, _), llm, r1, r8 in zip(runs, engines, b1, b8, strict=True):
            name = llm.llm_engine.runner.backend.name
            rows.append(dict(context=ctx, mode=label, attention_backend=name, batch1_tok_s=statistics.median(r1),
                             batch8_tok_s=statistics.median(r8), batch1_rounds=r1, batch8_rounds=r8))
            print(f"context {ctx:>5} {label:<24} {name:<11} batch 1 {rows[-1]['batch1_tok_s']:6.1f} tok/s   "
                  f"batch 8 {rows[-1]['batch8_tok_s']:6.1f} tok/s (medians of {args.rounds} rounds)", flush=True)
        del engines
    print("\nvs the fp32 cache (auto), same context and rounds:")
    for r in rows:
        auto = next(a for a in rows if a["context"] == r["context"] and a["mode"] == "auto")
        r["batch1_vs_auto"], r["batch8_vs_auto"] = (r["batch1_tok_s"] / auto["batch1_tok_s"],
                                                    r["batch8_tok_s"] / auto["batch8_tok_s"])
        print(f"context {r['context']:>5} {r['mode']:<24} {r['attention_backend']:<11} batch 1 "
              f"{r['batch1_vs_auto']:.2f}x   batch 8 {r['batch8_vs_auto']:.2f}x")
    write_json(dict(tokens=args.tokens, rounds=args.rounds, modes=rows),
               Path(args.out or ROOT / "benchmarks" / "results" / "kv_cache_speed.json"))


def top2_gap(logprobs: Any, top2: Any) -> Any:
    """[positions]: logprob of the first of ``top2`` [positions, 2] minus that of the second."""
    pair = logprobs.gather(1, top2)
    return pair[:, 0] - pair[:, 1]


def main() -> None:
    args = parse_args()
    if args.speed:
        speed(args)
        return
    if not Path(args.data).is_file():
        raise SystemExit(f"{args.data}: no such text file; pass --data FILE (wikitext-2 test.txt by default)")
    import torch

    from qpage import LLM
    from qpage.eval.perplexity import kl_rows, nll_sum, score_window, token_windows
    from qpage.formats.gguf import default_model_dir

    # The fp32 weights, not the packed GGUF: its matmuls round activations to int8, and any
    # change to a layer's input re-rounds them (between two caches that alone is a mean KL of
    # about 4e-3 on this model), which would hide the caches' own differences.
    model = args.model or str(default_model_dir())
    engines = {}
    for label, kwargs in MODES:
        llm = LLM(model=model, kv_cache_memory="64MiB", enable_prefix_caching=False,
                  max_model_len=max(args.window, 16), log_stats=False, **kwargs)
        engines[label] = llm.llm_engine
    ref = engines["auto"]
    windows = token_windows(ref.tokenizer, Path(args.data), args.window, args.windows,
                            max_chars=200 * args.window * args.windows)
    nll = dict.fromkeys(engines, 0.0)
    kl = dict.fromkeys(engines, 0.0)
    kl_max = dict.fromkeys(engines, 0.0)
    gap_shift: dict[str, list[torch.Tensor]] = {k: [] for k in engines}
    count = 0
    t0 = time.perf_counter()
    for w, ids in enumerate(windows):
        base = score_window(ref, ids, args.chunk)
        top2 = base.topk(2, dim=-1).indices
        nll["auto"] += nll_sum(base, ids)
        for label, eng in engines.items():
            if label == "auto":
                continue
            lp = score_window(eng, ids, args.chunk)
            nll[label] += nll_sum(lp, ids)
            rows = kl_rows(base, lp)
            kl[label] += float(rows.sum())
            kl_max[label] = max(kl_max[label], float(rows.max()))
            gap_shift[label].append((top2_gap(lp, top2) - top2_gap(base, top2)).abs())
        count += len(ids) - 1
        print(f"window {w + 1}/{len(windows)} ({time.perf_counter() - t0:.0f} s): "
              + ", ".join(f"{k} ppl {math.exp(v / count):.4f}" for k, v in nll.items()), flush=True)
    result = dict(model=ref.model_dir.name, model_dtype=str(ref.dtype), data=Path(args.data).name,
                  windows=len(windows), window=args.window, chunk=args.chunk, tokens_scored=count,
                  modes=mode_rows(engines, nll, kl, kl_max, gap_shift, count))
    out = Path(args.out or ROOT / "benchmarks" / "results" / "kv_cache.json")
    write_json(result, out)
    print(f"\n{result['model']} ({result['model_dtype']}), {len(windows)} windows x {args.window} tokens, "
          f"chunk {args.chunk}: {count} positions scored")
    print(f"{'mode':<24} {'B/token':>8} {'vs fp16':>8} {'vs auto':>8} {'perplexity':>11} {'d ppl %':>8} "
          f"{'mean KL':>10} {'max KL':>8} {'gap shift mean/p99/max':>23}")
    for r in result["modes"]:
        print(f"{r['mode']:<24} {r['bytes_per_token']:>8} {r['vs_fp16']:>8.4f} {r['vs_auto']:>8.4f} "
              f"{r['perplexity']:>11.4f} {r['ppl_delta_pct']:>+8.3f} {r['mean_kl']:>10.2e} {r['max_kl']:>8.3f} "
              f"{r['gap_shift_mean']:>7.3f}/{r['gap_shift_p99']:.3f}/{r['gap_shift_max']:.3f}")
    print(f"wrote {out}")


def mode_rows(engines: dict[str, Any], nll: dict[str, float], kl: dict[str, float], kl_max: dict[str, float],
              gap_shift: dict[str, list[Any]], count: int) -> list[dict[str, Any]]:
    """One row per mode: bytes per token (against fp16 and ``auto``), perplexity and its change,
    KL and the top-2 gap shift's mean, 99th percentile and maximum."""
    import torch

    from qpage.layers.attention.kv_format import KVCacheSpec

    ref = engines["auto"]
    a = ref.arch
    fp16_bytes = KVCacheSpec(torch.float16).bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim)
    auto_bytes = ref.kv_spec.bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim)
    ppl_auto = math.exp(nll["auto"] / count)
    rows = []
    for label, eng in engines.items():
        b = eng.kv_spec.bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim)
        ppl = math.exp(nll[label] / count)
        shift = torch.cat(gap_shift[label]) if gap_shift[label] else torch.zeros(1)
        rows.append(dict(mode=label, kv_cache=eng.kv_spec.describe(), bytes_per_token=b, vs_fp16=b / fp16_bytes,
                         vs_auto=b / auto_bytes, perplexity=ppl, ppl_delta_pct=100 * (ppl / ppl_auto - 1),
                         mean_kl=kl[label] / count if label != "auto" else 0.0, max_kl=kl_max[label],
                         gap_shift_mean=float(shift.mean()), gap_shift_p99=float(shift.quantile(0.99)),
                         gap_shift_max=float(shift.max()), fp16_bytes_per_token=fp16_bytes))
    return rows

if __name__ == "__main__":
    main()
