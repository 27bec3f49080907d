"""Structured outputs: decode speed with a JSON schema against unconstrained decoding, and
what the grammar libraries cost (compile time, time to fill one token mask).

Speed: the default model generates ``--tokens`` tokens for each of ``--batch`` chat prompts
(batch 1 and 8 by default), unconstrained (``ignore_eos``) and constrained to a JSON schema
long enough that no output completes before ``--tokens`` (an array of 40 records), so both
run the same number of steps. Each of ``--rounds`` rounds times every (batch, mode) once, in
turn; medians are reported, and the ratio is the median of the rounds' own ratios (the two
modes of a round run back to back, so they share the machine's load). The engine's own mask
work per step (one mask filled per row, then the batch masked in one op) is also timed
alone, on a batch of ``max(--batch)`` rows walking a valid output.

Libraries: XGrammar (what the engine uses) and llguidance, on the same tokenizer and
schemas: tokenizer preparation (once per engine), compiling a new schema (median over
``--schemas`` distinct ones), a cached compile, and the mean time to fill one token mask
while walking a valid output token by token.

    python benchmarks/structured_output.py [--tokens 128] [--batch 1 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "List forty people with their name, age and city, as JSON."}]
RECORD = {"type": "object", "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16}}}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 40, "maxItems": 40}
WALK_SCHEMA = json.dumps({"type": "array", "items": RECORD})
WALK = json.dumps([{"name": f"Ada {i}", "age": 30 + i, "city": "London"} for i in range(10)])
"""A valid output of WALK_SCHEMA, walked token by token to time the masks."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="concurrent requests")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--schemas", type=int, default=8, help="distinct schemas compiled per library")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured_output.json"))
    return p.parse_args()


def decode_speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    from qpage import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(log_stats=False)
    so = StructuredOutputsParams(json=SCHEMA)
    modes = {"unconstrained": dict(ignore_eos=True), "json schema": dict(structured_outputs=so)}

    def run(batch: int, mode: str) -> tuple[float, int]:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.tokens, **modes[mode])
                  for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.chat([CHAT] * batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    run(1, "json schema")  # warm up: the grammar compiled and cached, the kernels built
    times: dict[tuple[int, str], list[float]] = {(b, m): [] for b in args.batch for m in modes}
    for r in range(args.rounds):
        for key in times:
            dt, n = run(*key)
            times[key].append(n / dt)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"b{b} {m} {v[-1]:.1f}" for (b, m), v in times.items()),
              flush=True)
    rows = []
    for b in args.batch:
        free, con = (statistics.median(times[(b, m)]) for m in modes)
        ratio = statistics.median(c / f for f, c in zip(times[(b, "unconstrained")], times[(b, "json schema")],
                                                         strict=True))
        rows.append(dict(batch=b, unconstrained_tok_s=free, json_schema_tok_s=con, ratio=ratio,
                         rounds_unconstrained=times[(b, "unconstrained")], rounds_json=times[(b, "json schema")]))
    return rows


def mask_cost(batch: int) -> dict[str, Any]:
    """The engine's mask work for ``batch`` constrained rows walking a valid output: the
    whole per-step cost (fill, mask, accept), and the masking op alone against XGrammar's
    CPU kernel on the same masks."""
    import torch
    import xgrammar as xgr

    from qpage import StructuredOutputsParams
    from qpage.engine.structured import GrammarCompiler, token_masks
    from qpage.engine.tokenizers import eos_token_ids, load_tokenizer
    from qpage.models.loader import resolve_model_dir
    from qpage.runner.sampler import apply_bitmask

    model_dir = resolve_model_dir(None)
    tok = load_tokenizer(model_dir)
    compiler = GrammarCompiler(tok, len(tok), eos_token_ids(model_dir, tok))
    so = StructuredOutputsParams(json=json.loads(WALK_SCHEMA), disable_any_whitespace=True)
    guides = [compiler.guide(so) for _ in range(batch)]
    walk = tok.encode(WALK, add_special_tokens=False)
    logits = torch.zeros(batch, len(tok))
    t0 = time.perf_counter()
    rows = list(range(batch))
    for t in walk:
        apply_bitmask(logits, token_masks(guides, len(tok))[0], rows)
        for g in guides:
            assert g.accept(t)
    step = (time.perf_counter() - t0) / len(walk)
    guides = [compiler.guide(so) for _ in range(batch)]
    masks = []
    for t in walk:
        bm = torch.full((batch, -(-len(tok) // 32)), -1, dtype=torch.int32)
        for i, g in enumerate(guides):
            g.fill(bm, i)
            assert g.accept(t)
        masks.append(bm)
    cost = {}
    for name, fn in (("ours", lambda lg, bm: apply_bitmask(lg, bm, rows)),
                     ("xgrammar", lambda lg, bm: xgr.apply_token_bitmask_inplace(lg, bm))):
        t0 = time.perf_counter()
        for bm in masks:
            fn(logits, bm)
        cost[name] = 1e6 * (time.perf_counter() - t0) / len(masks)
    return dict(batch=batch, steps=len(walk), mask_us_per_step=1e6 * step, apply_us=cost["ours"],
                xgrammar_apply_us=cost["xgrammar"])


def _schemas(n: int) -> list[str]:
    """``n`` distinct schemas (a property renamed), so that no compile is a cache hit."""
    return [json.dumps({**RECORD, "properties": {**RECORD["properties"], f"extra_{i}": {"type": "boolean"}}})
            for i in range(n)]


def libraries(args: argparse.Namespace) -> list[dict[str, Any]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import xgrammar as xgr

    from qpage.engine.tokenizers import load_tokenizer
    from qpage.models.loader import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    vocab = len(tok)
    walk = tok.encode(WALK, add_special_tokens=False)
    schemas = _schemas(args.schemas)
    rows = []

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    prep = time.perf_counter() - t0
    cold = []
    for s in schemas:
        t0 = time.perf_counter()
        compiler.compile_json_schema(s)
        cold.append(time.perf_counter() - t0)
    compiler.compile_json_schema(schemas[0])
    t0 = time.perf_counter()
    compiler.compile_json_schema(schemas[0])
    cached = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(WALK_SCHEMA))
    mask = xgr.allocate_token_bitmask(1, vocab)
    t0 = time.perf_counter()
    for t in walk:
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(t)
    rows.append(dict(library=f"xgrammar {version('xgrammar')}", tokenizer_s=prep,
                     compile_ms=1e3 * statistics.median(cold), cached_compile_ms=1e3 * cached,
                     mask_us=1e6 * (time.perf_counter() - t0) / len(walk)))

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    prep = time.perf_counter() - t0
    cold = []
    for s in schemas:
        t0 = time.perf_counter()
        llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(s))
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()  # llguidance keeps no cache: the same schema is compiled again
    llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(schemas[0]))
    cached = time.perf_counter() - t0
    lm = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(WALK_SCHEMA))
    lmask = llt.allocate_token_bitmask(1, vocab)
    t0 = time.perf_counter()
    for t in walk:
        llt.fill_next_token_bitmask(lm, lmask, 0)
        assert lm.consume_token(t)
    rows.append(dict(library=f"llguidance {version('llguidance')}", tokenizer_s=prep,
                     compile_ms=1e3 * statistics.median(cold), cached_compile_ms=1e3 * cached,
                     mask_us=1e6 * (time.perf_counter() - t0) / len(walk)))
    return rows


def main() -> None:
    args = parse_args()
    libs = libraries(args)
    mask = mask_cost(max(args.batch))
    speed = decode_speed(args)
    result = dict(tokens=args.tokens, rounds=args.rounds, schema="array of 40 {name, age, city} records",
                  speed=speed, engine_mask=mask, libraries=libs)
    out = write_json(result, args.out)
    print(f"\ndecode tokens/s (default model, {args.tokens} tokens per request, median of {args.rounds} rounds)")
    print(f"{'batch':>5} {'unconstrained':>14} {'json schema':>12} {'ratio':>6}")
    for r in speed:
        print(f"{r['batch']:>5} {r['unconstrained_tok_s']:>14.1f} {r['json_schema_tok_s']:>12.1f} {r['ratio']:>6.2f}")
    step_ms = 1e3 * mask["batch"] / next(r["unconstrained_tok_s"] for r in speed if r["batch"] == max(args.batch))
    print(f"engine mask work at batch {mask['batch']}: {mask['mask_us_per_step']:.0f} us per step "
          f"(a decode step takes {step_ms:.1f} ms unconstrained); the masking op alone "
          f"{mask['apply_us']:.0f} us, XGrammar's CPU kernel on the same masks {mask['xgrammar_apply_us']:.0f} us")
    print("\ngrammar libraries (same tokenizer and schemas)")
    print(f"{'library':<20} {'tokenizer s':>11} {'compile ms':>10} {'cached ms':>9} {'mask us/token':>13}")
    for r in libs:
        print(f"{r['library']:<20} {r['tokenizer_s']:>11.3f} {r['compile_ms']:>10.2f} {r['cached_compile_ms']:>9.3f} "
              f"{r['mask_us']:>13.1f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
