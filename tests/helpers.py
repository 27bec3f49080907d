"""Shared test helpers: drive the model runner directly, without a tokenizer or scheduler;
compare greedy outputs of two different numerics by one rule."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qpage.engine.kv_cache import KVCacheManager, kv_layout
from qpage.engine.request import Request
from qpage.models.loader import load_model, read_arch_config
from qpage.runner.batch import ScheduledRequest, SchedulerOutput
from qpage.runner.model_runner import ModelRunner
from qpage.sampling_params import SamplingParams


class RunnerHarness:
    """A model + paged cache + runner, stepped by hand (what the scheduler would do)."""

    def __init__(self, model_dir: Path, num_blocks: int = 64, max_len: int = 512,
                 dtype: torch.dtype = torch.float32, dequantize_weights: bool = False) -> None:
        self.arch = read_arch_config(model_dir)
        self.model = load_model(model_dir, self.arch, dtype, torch.device("cpu"), max_len,
                                dequantize_weights=dequantize_weights)
        layout = kv_layout(self.arch, max_len)
        self.kv = KVCacheManager(num_blocks, enable_caching=False, layout=layout)
        self.runner = ModelRunner(self.model, self.arch, num_blocks, dtype, torch.device("cpu"), kv_layout=layout)

    def request(self, rid: str, ids: list[int]) -> Request:
        return Request(rid, ids, SamplingParams(prompt_logprobs=0), 1000, set())

    def step(self, work: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
        """Compute ``n`` more tokens of each request; return its logits for those tokens
        (all prompt positions during prefill, the last one afterwards)."""
        sched = SchedulerOutput()
        for req, n in work:
            assert self.kv.allocate_slots(req, n) is not None
            done = req.num_computed_tokens + n >= req.num_tokens
            sched.scheduled.append(ScheduledRequest(req, n, done, self.kv.block_tables(req.request_id)))
        out = self.runner.logits(sched)
        logits: dict[str, list[torch.Tensor]] = {}
        for rid, (_, lg) in out.prompt_logits.items():
            logits.setdefault(rid, []).append(lg)
        for i, s in enumerate(out.sample_requests):
            logits.setdefault(s.request.request_id, []).append(out.logits[i : i + 1])  # type: ignore[index]
        for req, n in work:
            req.num_computed_tokens += n
        return {k: torch.cat(v) for k, v in logits.items()}


def effective_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a (bias-free) linear layer's forward multiplies by, as its kernel
    holds it: the layer applied to the identity (exact: one nonzero product per output)."""
    eye = torch.eye(linear.in_features, dtype=torch.float32)
    with torch.inference_mode():
        return linear(eye).float().t()


NEAR_TIE = 0.2
"""Nats. Where two greedy runs with different numerics (an int8 KV cache or a quantized weight
format against fp32, one kernel path against another, N ranks against one) pick different
tokens, the scores that decided must hold the two picks within this of each other. Such
noise moves the gap between two tokens' logprobs by under 0.1 at the 99th percentile (an
int8 cache: 0.088 over 8176 positions, docs/kv-cache.md#quality), so such runs flip only
near-ties, while a fault moves tokens by far more. An FP8 cache moves gaps by several times
that (99th percentile 0.39): FP8 runs are compared with fp32 runs by KL instead (two paths
over one FP8 cache may still be compared by this rule)."""


def first_parting(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ, None where they are equal. A sequence
    that is a strict prefix of the other parts at its end."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def parting_margins(want: Any, got: Any) -> tuple[int, float] | None:
    """Where two greedy completions of one prompt part (``CompletionOutput``s with top
    ``logprobs``) and the larger of the two runs' margins there: each run's score
    for its own pick minus its score for the other run's pick. inf where a run's top logprobs
    do not hold the other's pick or a run ended there. None where the tokens are equal."""
    i = first_parting(want.token_ids, got.token_ids)
    if i is None:
        return None
    margin = 0.0
    for run, other in ((want, got), (got, want)):
        if i >= len(run.token_ids) or i >= len(other.token_ids):
            return i, float("inf")
        top = run.logprobs[i]
        pick, alt = run.token_ids[i], other.token_ids[i]
        margin = max(margin, top[pick].logprob - top[alt].logprob if alt in top else float("inf"))
    return i, margin


def assert_greedy_agrees(want: Any, got: Any, tie: float = NEAR_TIE) -> int | None:
    """The one rule for greedy outputs of two different numerics: equal up to where they part,
    and the parting at a near-tie (both runs' margins there under ``tie``, NEAR_TIE unless a
    test has measured its noise to be smaller). The margins must be read on the scores that
    decide: ask for ``logprobs=5`` (a near-tie may hold three tokens, and each run's top list
    must hold the other's pick), and run with ``logprobs_mode="processed_logprobs"``
    where penalties, ``min_tokens`` or a grammar apply (without them raw and processed agree).
    Returns where they part, None where they are equal."""
    parted = parting_margins(want, got)
    if parted is None:
        return None
    i, margin = parted
    assert margin < tie, (f"greedy outputs part at token {i} with a margin of {margin:.4f} nats (not a near-tie "
                          f"under {tie}): want {want.token_ids[i:i + 3]}, got {got.token_ids[i:i + 3]}, "
                          f"scores there {want.logprobs[i] if i < len(want.logprobs) else None} / "
                          f"{got.logprobs[i] if i < len(got.logprobs) else None}")
    return i
