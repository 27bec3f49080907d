"""Token sampling for a batch of requests, each with its own SamplingParams.

Order per row: raw log-probabilities (returned as ``logprobs``, as vLLM does by default)
-> penalties -> min_tokens masking -> the structured-output mask (each constrained row's
allowed tokens come as a bitmask row, applied to the batch in one op; log-probabilities here are
returned instead under ``processed_logprobs``: the scores greedy decoding picks from) -> greedy
argmax, or temperature, top-k, top-p, min-p and a draw. A draw inverts the row's CDF at one
uniform number taken from the request's own random stream when it has a seed, so a seed
reproduces its output whatever else shares the batch. ``sample`` keeps one row's failure its
own: the uniforms are drawn once, before anything can fail, and a batch that raises is sampled
again row by row with the same ones.

``verify`` samples a speculating request's rows (its last known token's, then one per draft
token) as if they came one at a time, each seeing the drafts before it as output (so penalties
and min_tokens apply as they would), and keeps tokens up to the first one that differs from the
draft. A draft that is a single guessed token (n-gram lookup) makes this exact rejection
sampling: a draft token survives with the model's probability of it, and the first differing
token is a draw from the model's distribution. A seeded request's stream is rewound to the
uniforms of the rows it kept, so seeded outputs equal those without speculation.
"""

from __future__ import annotations

import logging
import random

import torch

from qpage.runner.batch import Logprob, SampleResult, Sequence, with_drafts

log = logging.getLogger("qpage.engine")

MASKED_LOGPROB = -9999.0
"""The processed log-probability reported for a token that penalties or masks forbid (vLLM's floor)."""

Masks = list[torch.Tensor | None]
"""Per sampled row, the allowed tokens as int32 words or None (``verify`` takes per request
``batch.ScheduledRequest.token_mask``: one such row for its last token and each draft)."""


class Sampler:
    def __init__(self, seed: int, processed_logprobs: bool = False) -> None:
        self.rng = random.Random(seed)
        self.processed_logprobs = processed_logprobs
        """Report log-probabilities after penalties and masks (vLLM's ``processed_logprobs``)."""

    def uniforms(self, reqs: list[Sequence]) -> list[float | None]:
        """Each random row's uniform (None for greedy rows), from its own stream when seeded."""
        return [None if r.params.greedy else (r.rng or self.rng).random() for r in reqs]

    def sample(self, logits: torch.Tensor, reqs: list[Sequence],
               masks: Masks | None = None) -> tuple[SampleResult, dict[int, str]]:
        """Sample every row: (result, {row: error}). If the batch raises, each row is sampled
        alone with the uniform it had, so a row that still fails fails alone (its token is a
        placeholder) and the others get what the batch would have given them."""
        u = self.uniforms(reqs)
        masks = masks or [None] * len(reqs)
        try:
            return self(logits, reqs, u, masks), {}
        except Exception:
            log.warning("qpage: sampling a batch of %d failed; sampling it row by row", len(reqs), exc_info=True)
        parts, failed = [], {}
        for i, r in enumerate(reqs):
            try:
                parts.append(self(logits[i : i + 1], [r], u[i : i + 1], masks[i : i + 1]))
            except Exception as e:
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
                parts.append(SampleResult([0], [None], [None]))
        return SampleResult.concat(parts), failed

    def verify(self, logits: torch.Tensor, reqs: list[Sequence], drafts: list[list[int]],
               masks: Masks | None = None) -> tuple[list[Sequence], SampleResult, dict[int, str]]:
        """Sample each request's rows (1 + len(drafts[i]) consecutive rows of ``logits``) and keep
        its tokens up to the first that is not its draft: (one request entry per kept token,
        their sample results, {kept row: error}). A row that fails keeps that token alone."""
        masks = masks or [None] * len(reqs)
        rows: list[Sequence] = []
        row_masks: Masks = []
        states = []
        for r, d, m in zip(reqs, drafts, masks, strict=True):
            rows.extend(with_drafts(r, d[:j]) if j else r for j in range(len(d) + 1))
            row_masks.extend([None] * (len(d) + 1) if m is None else list(m[: len(d) + 1]))
            states.append(r.rng.getstate() if d and r.rng is not None and not r.params.greedy else None)
        res, failed = self.sample(logits, rows, row_masks)
        kept_reqs: list[Sequence] = []
        keep: list[int] = []
        kept_failed: dict[int, str] = {}
        row = 0
        for r, d, state in zip(reqs, drafts, states, strict=True):
            n = 1  # rows kept: the first, then one more for each draft its row's token equals
            while n <= len(d) and row + n - 1 not in failed and res.token_ids[row + n - 1] == d[n - 1]:
                n += 1
            for j in range(row, row + n):
                if j in failed:
                    kept_failed[len(keep)] = failed[j]
                keep.append(j)
                kept_reqs.append(r)
            if state is not None and n <= len(d):  # rows past the first differing one drew for nothing
                r.rng.setstate(state)  # type: ignore[union-attr]
                for _ in range(n):
                    r.rng.random()  # type: ignore[union-attr]
            row += len(d) + 1
        kept = SampleResult([res.token_ids[i] for i in keep], [res.logprobs[i] for i in keep],
                            [res.top_logprobs[i] for i in keep])
        return kept_reqs, kept, kept_failed

    def __call__(self, logits: torch.Tensor, reqs: list[Sequence],
                 uniforms: list[float | None] | None = None, masks: Masks | None = None) -> SampleResult:
        """One batch; ``uniforms`` as from ``uniforms(reqs)`` (drawn here when None)."""
        uniforms = self.uniforms(reqs) if uniforms is None else uniforms
        masks = masks or [None] * len(reqs)
        want_lp = [r.params.logprobs is not None for r in reqs]
        report_raw = any(want_lp) and not self.processed_logprobs
        lp = torch.log_softmax(logits, dim=-1) if report_raw else None
        logits = self._penalize(logits, reqs, masks)
        rows = [i for i, m in enumerate(masks) if m is not None]
        if rows:
            logits = logits.clone()  # masked in place; the caller's logits stay as they were
            apply_bitmask(logits, torch.stack([masks[i] for i in rows]), rows)  # type: ignore[misc]
        if any(want_lp) and self.processed_logprobs:  # a masked token reports a finite floor (JSON has no -inf)
            lp = torch.log_softmax(logits, dim=-1).clamp_min(MASKED_LOGPROB)
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand_rows:
            idx = torch.tensor(rand_rows, dtype=torch.long)
            tokens[idx] = self._draw(logits[idx], [reqs[i] for i in rand_rows], [uniforms[i] for i in rand_rows])
        token_list = tokens.tolist()
        lps: list[float | None] = [None] * len(reqs)
        tops: list[dict[int, Logprob] | None] = [None] * len(reqs)
        if lp is not None:
            for i, r in enumerate(reqs):
                if want_lp[i]:
                    tops[i] = top_logprobs(lp[i], token_list[i], r.params.logprobs or 0)
                    lps[i] = tops[i][token_list[i]].logprob  # type: ignore[index]
        return SampleResult(token_list, lps, tops)

    @staticmethod
    def _penalize(logits: torch.Tensor, reqs: list[Sequence], masks: Masks) -> torch.Tensor:
        blocks = [_blocks_stop(r, m is not None) for r, m in zip(reqs, masks, strict=True)]
        rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties or blocks[i]]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            r, p, row = reqs[i], reqs[i].params, logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(r.all_token_ids, dtype=torch.long).unique()
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                out = torch.tensor(r.output_token_ids, dtype=torch.long)
                counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if blocks[i]:
                eos = () if p.ignore_eos else tuple(r.eos_token_ids)
                banned = [t for t in (*eos, *(p.stop_token_ids or ())) if t < vocab]
                if banned:
                    row[banned] = float("-inf")
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, reqs: list[Sequence], uniforms: list[float | None]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        logits = logits / temps[:, None]
        logits = _top_k_top_p(logits, reqs)
        probs = torch.softmax(logits, dim=-1)
        min_ps = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype)
        if bool((min_ps > 0).any()):
            floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        # Inverse-CDF draw: one uniform per row (from the request's own stream when seeded)
        # instead of one exponential per vocabulary entry (a large vocabulary made that costly).
        cdf = probs.cumsum(dim=-1)
        u = torch.tensor(uniforms, dtype=torch.float64)
        # side="right": the first index whose cdf exceeds u, never a zero-probability token;
        # a product that rounds up to the total is held to the last token with mass.
        idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True).squeeze(1)
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        return torch.minimum(idx, last)


def _blocks_stop(r: Sequence, constrained: bool) -> bool:
    """min_tokens not reached yet: EOS and stop tokens must not be sampled (a grammar's own
    end is not blocked: the grammar decides when a structured output is complete)."""
    return not constrained and len(r.output_token_ids) < r.params.min_tokens


def _top_k_top_p(logits: torch.Tensor, reqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in reqs]
    ps = [r.params.top_p for r in reqs]
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1])[None, :]
    drop = rank >= torch.tensor(ks)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the mass before it is below top_p (the top token is always kept).
    before = probs.cumsum(dim=-1) - probs
    drop = before >= torch.tensor(ps, dtype=probs.dtype)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def top_logprobs(row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The sampled token's logprob and rank (1 = most likely), plus the top ``k`` tokens."""
    chosen = float(row[token])
    out = {token: Logprob(chosen, int((row > row[token]).sum()) + 1)}
    if k > 0:
        vals, ids = row.topk(k)
        for rank, (v, t) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True), start=1):
            if t not in out:
                out[t] = Logprob(v, rank)
    return out


def _byte_mask() -> torch.Tensor:
    """[256, 8] float32: row b holds 0 where bit j of byte b is set (token allowed), else -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf"))


_BYTE_MASK = _byte_mask()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask ``logits[rows[j]]`` by ``bitmask[j]`` (int32 words, bit k of word w = token
    32w + k allowed) in one op: the bitmask's bytes index a 256-entry table of 8 additive
    masks (0 or -inf), and the result is added to the logits. Plain torch, so it runs on any
    device (docs/structured-outputs.md compares it with XGrammar's CPU kernel). Reading the
    words as bytes in token order assumes a little-endian host (x86-64, ARM64)."""
    vocab = logits.shape[-1]
    codes = bitmask.view(torch.uint8).flatten().to(device=logits.device, dtype=torch.long)
    add = _BYTE_MASK.to(device=logits.device, dtype=logits.dtype).index_select(0, codes).view(len(rows), -1)
    if len(rows) == logits.shape[0]:
        logits.add_(add[:, :vocab])
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] += add[:, :vocab]
