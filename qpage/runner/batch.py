"""What the engine and the runner exchange for one step: the scheduler's output in (each
request's new tokens, block table and, when it samples under a constraint, its allowed
tokens as data), token ids and logprobs out. The runner reads a request through
``Sequence``, the few fields it needs, so it imports nothing from the engine above it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from qpage.sampling_params import SamplingParams


class Sequence(Protocol):
    """What the runner reads of one sequence (``engine.request.Request`` provides it)."""

    request_id: str
    params: SamplingParams
    all_token_ids: list[int]
    """Prompt then output tokens."""
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    """Tokens whose K/V are in the cache before this step."""
    eos_token_ids: set[int]
    rng: random.Random | None
    """The sequence's own random stream when its params carry a seed."""


class DraftedSequence:
    """A sequence seen as if ``drafts`` had been appended to its output: what its row for the
    token after them is sampled with (penalties and min_tokens count the drafts). Every other
    field is the sequence's own (its random stream included)."""

    def __init__(self, seq: Sequence, drafts: list[int]) -> None:
        self._seq = seq
        self.all_token_ids = seq.all_token_ids + drafts
        self.output_token_ids = seq.output_token_ids + drafts

    def __getattr__(self, name: str) -> object:
        return getattr(self._seq, name)


def with_drafts(seq: Sequence, drafts: list[int]) -> Sequence:
    """``seq`` with ``drafts`` appended as output (a view for sampling; ``seq`` is unchanged)."""
    return cast(Sequence, DraftedSequence(seq, drafts))


@dataclass(slots=True)
class ScheduledRequest:
    request: Sequence
    num_tokens: int
    """Tokens computed for it this step, starting at ``request.num_computed_tokens``."""
    samples: bool
    """True when the step reaches the end of its known tokens, so a new token is sampled."""
    block_tables: list[list[int]] = field(default_factory=list)
    """Its block table of each KV group for this step (every block its tokens up to the
    step's end use; ``layers.attention.kv_layout``)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: guessed tokens computed after the request's last one (counted in
    ``num_tokens``); every row of the chunk is sampled and the longest agreeing prefix kept."""
    token_mask: torch.Tensor | None = None
    """Constrained sampling: [1 + len(draft_token_ids), words] int32, the tokens its grammar
    allows next and after each draft token (bit k of word w = token 32w + k), set by the engine
    before the step; None when unconstrained."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Requests run this step, running ones first, in batch order."""
    num_batched_tokens: int = 0
    """Sum of ``num_tokens`` over ``scheduled``: at most ``max_num_batched_tokens``."""
    preempted: list[str] = field(default_factory=list)
    """Ids of requests preempted (blocks freed, sent back to waiting) during this step."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    """Log-probability of each sampled token (raw or processed, as the sampler was built); None when not asked."""
    top_logprobs: list[dict[int, Logprob] | None]
    """Per row, the sampled token and the top ``logprobs`` tokens; None when not asked."""

    @staticmethod
    def concat(parts: list[SampleResult]) -> SampleResult:
        return SampleResult([t for p in parts for t in p.token_ids], [x for p in parts for x in p.logprobs],
                            [x for p in parts for x in p.top_logprobs])


@dataclass
class StepLogits:
    """A step's logits, for the sampler or for scoring (fp32, on the CPU)."""

    sample_requests: list[ScheduledRequest] = field(default_factory=list)
    """Entries that sample a token this step, in the row order of ``logits``."""
    logits: torch.Tensor | None = None
    """[rows, vocab]: per entry of ``sample_requests``, 1 + its draft tokens consecutive rows."""
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """request id -> (first prompt position, logits [rows, vocab]) for prompt_logprobs: row r
    predicts the prompt token at position first + r + 1."""


@dataclass
class StepResult:
    """What a step returns to the engine: sampled tokens and logprobs, never full logits."""

    sample_requests: list[Sequence] = field(default_factory=list)
    """The sequence of each token in ``sampled``: one entry per token, a sequence's tokens
    consecutive and in order (more than one when it kept draft tokens)."""
    sampled: SampleResult = field(default_factory=lambda: SampleResult([], [], []))
    failed_rows: dict[int, str] = field(default_factory=dict)
    """Row -> why sampling it failed (that request alone ends)."""
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    """request id -> (first position predicted, one entry per predicted prompt token)."""
