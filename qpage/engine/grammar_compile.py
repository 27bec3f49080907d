"""One grammar compile, and the trial every new grammar passes before it is accepted.

A grammar that allows no token at the start matches no text; one whose masks grow slow along a
random walk of allowed tokens (ambiguous rules such as ``s ::= s s``, whose mask time grows
with the output to hundreds of milliseconds per token) is refused before it joins a batch; so
is one whose walk reaches a point where no token may follow (characters the vocabulary cannot
produce). The engine's per-step mask budget (``structured.MaskBudget``) stays the bound for
grammars that turn slow only past the walk. Used in the compile process (``grammar_worker``)
and by the offline API's in-process compiles alike.
"""

from __future__ import annotations

import importlib
import statistics
import time
from typing import Any

import torch

PROBE_TOKENS = 64
"""Length of the seeded random walk of allowed tokens each new grammar is tried on."""
PROBE_MASK_S = 0.0025
"""Most seconds one mask may take at the walk's end (the median of its last ``PROBE_LAST``): half
the engine's per-step floor (``structured.MASK_FLOOR_S``). Ordinary grammars stay far below
(tens of microseconds); one that grows to this within 64 tokens passes the floor soon after."""
PROBE_LAST = 8


def compile_source(compiler: Any, kind: str, text: str, options: dict[str, Any]) -> Any:
    """One XGrammar compile, tried (``refusal``): ``kind`` json (a schema's text; ``options``
    are the compiler's keyword arguments), regex or grammar (EBNF). ValueError if refused."""
    if kind == "json":
        compiled = compiler.compile_json_schema(text, **options)
    elif kind == "regex":
        compiled = compiler.compile_regex(text)
    else:
        compiled = compiler.compile_grammar(text)
    why = refusal(compiled)
    if why is not None:
        raise ValueError(why)
    return compiled


def refusal(compiled: Any, tokens: int = PROBE_TOKENS, seed: int = 0) -> str | None:
    """Why ``compiled`` cannot be followed, or None: it allows no token at the start, or, along
    a seeded random walk of ``tokens`` allowed non-stop tokens, a step allows none (a dead end:
    the vocabulary lacks the bytes that must follow) or the masks end slower than
    ``PROBE_MASK_S``. A walk that reaches the grammar's end stops there."""
    info = compiled.tokenizer_info
    matcher = importlib.import_module("xgrammar").GrammarMatcher(compiled)
    mask = torch.zeros((1, -(-info.vocab_size // 32)), dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    stops = torch.tensor(list(info.stop_token_ids), dtype=torch.long)
    rng = torch.Generator().manual_seed(seed)
    times: list[float] = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        allowed = ((mask[0].unsqueeze(1) >> bits) & 1).flatten()[:info.vocab_size].bool()
        if len(times) > 1 and not allowed.any():
            return ("its text can reach a point where only characters that no token of this model's vocabulary "
                    f"produces may follow (after {len(times) - 1} tokens of a random walk); remove them from it")
        if not allowed.any():
            return ("it matches no text (not even an empty one); check it for a rule that never ends, "
                    "a character class that excludes everything, or characters that no token of this model's "
                    "vocabulary produces")
        allowed[stops] = False
        ids = allowed.nonzero().flatten()
        if not len(ids) or not matcher.accept_token(int(ids[torch.randint(len(ids), (1,), generator=rng)])):
            break
    cost = statistics.median(times[-PROBE_LAST:])
    if len(times) > PROBE_LAST and cost > PROBE_MASK_S:
        return (f"its allowed tokens took {cost * 1e3:.1f} ms to compute after {len(times)} tokens of output "
                f"(the bound is {PROBE_MASK_S * 1e3:g} ms) and grow slower with every token: the grammar is "
                "too ambiguous to follow; rewrite rules such as s ::= s s as right-recursive ones (s ::= x s | x)")
    return None
