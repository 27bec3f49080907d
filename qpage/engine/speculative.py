"""Draft tokens for speculative decoding: n-gram prompt lookup, and how many to verify.

A decoding request gets up to ``num_speculative_tokens`` guessed next tokens; the next step
computes them with the request's real token as one chunk, the sampler keeps the longest
prefix the model itself would have produced (``runner.sampler.Sampler.verify``) and the
scheduler takes back the cache slots of the rest. Because the CPU kernels give a row the same
bits whatever the batch (docs/design.md), the kept tokens are the ones decoding without
speculation gives.

The n-gram drafter looks up the context's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) at their latest earlier occurrence in the prompt and output, and
proposes the tokens that followed it: free to make, and right where the output quotes or edits
its input. Each request keeps its own count of drafted and accepted tokens; the number it
drafts follows what it has been getting back.
"""

from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from qpage.config import SpeculativeConfig
from qpage.engine.request import Request


def ngram_lookup(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of
    ``tokens`` (int64), trying n from ``hi`` down to ``lo``; [] when none occurs."""
    size = tokens.shape[0]
    for n in range(min(hi, size - 1), lo - 1, -1):
        # Windows of n tokens starting at i <= size - 1 - n: each has a next token, and the
        # suffix itself (starting at size - n) is not among them.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class SpeculationStats:
    """One request's drafted and accepted tokens, weighted toward recent steps."""

    __slots__ = ("accepted", "drafted")

    def __init__(self) -> None:
        self.drafted = 0.0
        self.accepted = 0.0

    def record(self, drafted: int, accepted: int, decay: float = 0.8) -> None:
        self.drafted = self.drafted * decay + drafted
        self.accepted = self.accepted * decay + accepted

    @property
    def rate(self) -> float:
        """Share of drafted tokens accepted (optimistic before any draft)."""
        return self.accepted / self.drafted if self.drafted > 0 else 1.0


class NgramDrafter:
    """Proposes each decoding request's drafts for the next step (``Request.draft_token_ids``)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats: weakref.WeakKeyDictionary[Request, SpeculationStats] = weakref.WeakKeyDictionary()

    @staticmethod
    def unfit_reason(req: Request) -> str | None:
        """Why ``req`` does not speculate (None: it does)."""
        if req.guide is not None:
            return "a structured output's grammar does not check draft tokens"
        return None

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        self.stats.setdefault(req, SpeculationStats()).record(drafted, accepted)

    def draft_length(self, req: Request) -> int:
        """Tokens to draft for ``req``: at most ``num_speculative_tokens``, fewer while its drafts
        are mostly rejected (the expected accepted run at its acceptance rate, plus one), and
        none past its ``max_tokens`` or the context limit."""
        k = self.config.num_speculative_tokens
        stats = self.stats.get(req)
        if stats is not None:
            rate = min(stats.rate, 0.999)
            k = min(k, max(1, round(rate / (1.0 - rate)) + 1))
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return max(0, min(k, room))

    def propose(self, req: Request) -> list[int]:
        """Drafts for ``req``, a request about to decode (its last token not yet in the cache)."""
        k = self.draft_length(req)
        if k <= 0 or self.unfit_reason(req) is not None:
            return []
        c = self.config
        tokens = np.asarray(req.all_token_ids, dtype=np.int64)
        return ngram_lookup(tokens, c.prompt_lookup_min or 1, c.prompt_lookup_max or 1, k)
