"""Draft tokens for speculative decoding: what every drafter shares (``Drafter``: how many to
verify), and n-gram prompt lookup (a draft model is ``engine.draft_model``).

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

import math
import weakref
from collections import Counter
from typing import cast

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from qpage.config import SpeculativeConfig
from qpage.engine.request import Request
from qpage.runner.batch import ScheduledRequest


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
    """One request's drafted and accepted tokens, recent steps weighted most, plus half a
    prior draft accepted at ``prior_rate``, so that a request starts by drafting and, once it
    stops because its drafts failed, slowly returns to trying (its evidence fades while it does
    not draft)."""

    __slots__ = ("accepted", "drafted", "prior_rate")
    PRIOR_DRAFTED = 0.5

    def __init__(self, prior_rate: float = 0.5) -> None:
        self.drafted = 0.0
        self.accepted = 0.0
        self.prior_rate = prior_rate

    def record(self, drafted: int, accepted: int, decay: float = 0.9) -> None:
        self.drafted = self.drafted * decay + drafted
        self.accepted = self.accepted * decay + accepted

    def fade(self, decay: float = 0.97) -> None:
        self.drafted *= decay
        self.accepted *= decay

    @property
    def rate(self) -> float:
        """Estimated chance that a draft token is accepted."""
        prior = self.PRIOR_DRAFTED
        return (self.accepted + prior * self.prior_rate) / (self.drafted + prior)


class StepCost:
    """Seconds per all-decode step by its row count (a moving average per count), and from it
    what one more row costs. Marginal, not average: on a CPU a few rows cost little more than
    one (the weights are read once), while in a batch each row's arithmetic shows. The cost of
    a row at R rows is the slope of a least-squares line through the counts seen between R/2
    and the most a step of R requests may take (``span`` rows each; at least 2R + 2), so one
    count's noise does not decide and the slope covers the rows drafts would add; where the
    counts there span less than R/2, through the nearest counts until they do; with fewer than
    two counts seen, a row is taken to cost ``PRIOR_ROW_SHARE`` of a one-row step."""

    PRIOR_ROW_SHARE = 0.1
    FLOOR = 0.02

    def __init__(self, weight: float = 0.2, span: int = 1) -> None:
        self.weight = weight
        self.span = span
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """Move the average at ``rows`` towards ``seconds``; a step slower than twice the average
        counts as twice it (a pause of the process is not the step's cost)."""
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + self.weight * (min(seconds, 2 * old) - old)

    def _fit(self, rows: int) -> tuple[float, float] | None:
        """(seconds per extra row, seconds of a step) at ``rows`` rows, from the line through
        the counts in the window above; where they span less than rows/2 (a slope between
        close counts is mostly noise), or lie outside it, through the counts nearest ``rows``
        until they do: a batch whose steps always carry drafts is seen only at larger counts,
        and must still be judged. None with fewer than two counts seen."""
        r = max(rows, 1)
        pts = [(x, t) for x, t in self.seconds.items() if r / 2 <= x <= max(2 * r + 2, self.span * r)]
        if len(pts) < 2 or max(x for x, _ in pts) - min(x for x, _ in pts) < r / 2:
            pts = []
            for p in sorted(self.seconds.items(), key=lambda p: abs(math.log(p[0] / r))):
                pts.append(p)
                if len(pts) >= 2 and max(x for x, _ in pts) - min(x for x, _ in pts) >= r / 2:
                    break
        if len(pts) < 2:
            return None
        n = len(pts)
        mx, mt = sum(x for x, _ in pts) / n, sum(t for _, t in pts) / n
        slope = sum((x - mx) * (t - mt) for x, t in pts) / sum((x - mx) ** 2 for x, _ in pts)
        return slope, mt + slope * (r - mx)

    def step_seconds(self, rows: int) -> float | None:
        """Seconds of a step of ``rows`` rows: the fitted line, or the one count seen; None
        when nothing near was seen."""
        fit = self._fit(rows)
        if fit is not None:
            return fit[1] if fit[1] > 0 else None
        return self.seconds.get(max(rows, 1))

    def row_share(self, rows: int) -> float:
        """What one more row adds to a step of ``rows`` rows, over the step's time per row
        (each row makes a token): a draft token must be accepted at least this often to pay."""
        r = max(rows, 1)
        fit = self._fit(r)
        if fit is None:
            return self.PRIOR_ROW_SHARE * r / (1.0 + self.PRIOR_ROW_SHARE * (r - 1))
        slope, now = fit
        return max(slope * r / now, self.FLOOR) if now > 0 else 1.0


class Drafter:
    """What every drafting method shares: per-request acceptance statistics, the step cost of
    the target, and how many tokens to draft (``draft_length``). ``propose`` sets each
    decoding request's drafts for the next step (``Request.draft_token_ids``).

    How many: the i-th draft token is kept only if the i - 1 before it are, so with acceptance
    rate a it adds a**i expected tokens for one row; it is drafted while a**i exceeds what the
    token costs as a share of the step (``threshold``): one more row of the target
    (``StepCost``), which grows with the batch, plus the drafting itself where it is not free.
    A large batch drafts only where drafts are nearly always right."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats: weakref.WeakKeyDictionary[Request, SpeculationStats] = weakref.WeakKeyDictionary()
        self.cost = StepCost(span=1 + config.num_speculative_tokens)

    def describe(self) -> str:
        """What drafts, for the start line."""
        return f"ngram, up to {self.config.num_speculative_tokens} tokens"

    def verified(self, scheduled: list[ScheduledRequest], emitted: Counter[str]) -> tuple[int, int, int]:
        """Record each verifying request's drafted and kept tokens (``emitted``: tokens each
        request kept this step, its own included); (verifying requests, drafts, accepted)."""
        counts = [0, 0, 0]
        for s in scheduled:
            if s.draft_token_ids:
                k = len(s.draft_token_ids)
                accepted = emitted[s.request.request_id] - 1
                self.record(cast(Request, s.request), k, accepted)
                counts = [counts[0] + 1, counts[1] + k, counts[2] + accepted]
        return counts[0], counts[1], counts[2]

    def prior_rate(self) -> float:
        """A new request's expected acceptance before its own drafts are checked: one half
        (n-gram drafts are right for one request and wrong for the next)."""
        return 0.5

    def request_stats(self, req: Request) -> SpeculationStats:
        stats = self.stats.get(req)
        if stats is None:
            stats = self.stats[req] = SpeculationStats(self.prior_rate())
        return stats

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        self.request_stats(req).record(drafted, accepted)

    def draft_length(self, req: Request, threshold: float) -> int:
        """Tokens to draft for ``req``: while rate**i > ``threshold``, at most
        ``num_speculative_tokens`` and none past its ``max_tokens`` or the context limit."""
        stats = self.request_stats(req)
        rate = min(stats.rate, 0.99)
        k = 0
        p = rate
        while k < self.config.num_speculative_tokens and p > threshold:
            k += 1
            p *= rate
        if k == 0:
            stats.fade()
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return max(0, min(k, room))

    def lengths(self, reqs: list[Request], threshold: float) -> list[int]:
        return [self.draft_length(r, threshold) for r in reqs]

    @staticmethod
    def grammar_checked(req: Request, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first that ``req``'s grammar refuses (all without one)."""
        return tokens if req.guide is None else tokens[: req.guide.allowed_prefix(tokens)]

    def propose(self, reqs: list[Request]) -> None:
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Drafts by prompt lookup (``ngram_lookup``): free to make, so a token pays when it is
    accepted more often than one more row of the step costs."""

    def propose(self, reqs: list[Request]) -> None:
        """Set the drafts of ``reqs``, the requests about to decode (last token not yet cached)."""
        c = self.config
        for req, k in zip(reqs, self.lengths(reqs, self.cost.row_share(len(reqs))), strict=True):
            if k <= 0:
                req.draft_token_ids = []
                continue
            tokens = np.asarray(req.all_token_ids, dtype=np.int64)
            drafts = ngram_lookup(tokens, c.prompt_lookup_min or 1, c.prompt_lookup_max or 1, k)
            req.draft_token_ids = self.grammar_checked(req, drafts)
