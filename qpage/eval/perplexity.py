"""Teacher-forced scoring through the engine's own paged-cache path.

``score_window`` runs one token window through the model runner chunk by chunk (chunked
prefill), so every chunk after the first attends to context read back from the KV cache:
exactly what an FP8 cache or a quantized model changes. It returns the next-token log
probabilities at every position; ``perplexity`` and ``kl_divergence`` reduce them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qpage.engine.request import Request
from qpage.eval.texts import read_text
from qpage.runner.batch import ScheduledRequest, SchedulerOutput
from qpage.sampling_params import SamplingParams

_ids = itertools.count()


def token_windows(tokenizer: Any, source: str | Path, window: int, count: int | None = None,
                  max_chars: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens from a text file or a built-in text
    (``texts.read_text``; the first ``count``)."""
    text = read_text(source)
    if max_chars is not None:
        text = text[:max_chars]
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    if not out:
        raise ValueError(f"{source}: fewer than {window} tokens; use a shorter window")
    return out[:count] if count is not None else out


def mixed_windows(tokenizer: Any, sources: list[str | Path] | tuple[str | Path, ...], window: int,
                  count: int) -> list[list[int]]:
    """``count`` windows drawn evenly from several texts (each source's first windows, taken in
    turn), so that no one text decides a calibration. A source with too few windows gives
    what it has and the others make up the count."""
    if not sources:
        raise ValueError("no calibration text given")
    per = [token_windows(tokenizer, s, window, count, max_chars=200 * window * count) for s in sources]
    out: list[list[int]] = []
    for i in range(count):
        for wins in per:
            if i < len(wins) and len(out) < count:
                out.append(wins[i])
    return out


@torch.inference_mode()
def score_window(engine: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """fp32 [len(ids) - 1, vocab]: log-softmax of the model's prediction of ids[1:]."""
    if len(ids) < 2:
        raise ValueError("a window needs at least 2 tokens")
    if len(ids) > engine.max_model_len:
        raise ValueError(f"window of {len(ids)} tokens exceeds max_model_len {engine.max_model_len}")
    req = Request(f"score-{next(_ids)}", list(ids), SamplingParams(prompt_logprobs=0, max_tokens=1), 1, set())
    kv, runner = engine.kv, engine.runner
    parts = []
    try:
        while req.num_computed_tokens < len(ids):
            n = min(chunk, len(ids) - req.num_computed_tokens)
            if kv.allocate_slots(req, n) is None:
                raise ValueError("the KV cache cannot hold the window; raise kv_cache_memory")
            sched = SchedulerOutput()
            sched.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n >= len(ids),
                                                    kv.block_tables(req.request_id)))
            out = runner.logits(sched)
            if req.request_id in out.prompt_logits:
                parts.append(out.prompt_logits[req.request_id][1])
            req.num_computed_tokens += n
    finally:
        kv.free(req)
    return torch.log_softmax(torch.cat(parts).float(), dim=-1)


def nll_sum(logprobs: torch.Tensor, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] under ``logprobs`` [len-1, vocab]."""
    target = torch.tensor(ids[1:], dtype=torch.long)
    return float(-logprobs.gather(1, target[:, None]).sum())


def kl_rows(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row of two log-probability tensors, in nats."""
    return (ref.exp() * (ref - other)).sum(-1)


def perplexity(engine: Any, windows: list[list[int]], chunk: int) -> Iterator[tuple[float, int]]:
    """(summed NLL, tokens) per window."""
    for ids in windows:
        yield nll_sum(score_window(engine, ids, chunk), ids), len(ids) - 1
