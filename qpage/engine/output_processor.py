"""From sampled tokens to RequestOutputs: detokenization, stop strings, logprobs, timings.

A prompt with ``n`` > 1 runs as ``n`` sequences (``Request`` objects); their parent state
here gathers them into one ``RequestOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from qpage.engine.detokenizer import IncrementalDetokenizer
from qpage.engine.metrics import EngineMetrics
from qpage.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from qpage.engine.request import Request
from qpage.runner.batch import SampleResult
from qpage.sampling_params import SamplingParams


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    completions: list[CompletionOutput]
    prompt_logprobs: PromptLogprobs | None = None
    done: list[bool] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(self.done)


class OutputProcessor:
    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.parents: dict[str, ParentState] = {}

    def add(self, parent: ParentState) -> None:
        parent.done = [False] * len(parent.children)
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        self.parents[parent.request_id] = parent

    def _token_text(self, lp: dict[int, Logprob]) -> dict[int, Logprob]:
        for t, v in lp.items():
            v.decoded_token = self.tokenizer.decode([t])
        return lp

    def add_prompt_logprobs(self, req: Request, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Entry r is the prompt token at ``first + r + 1`` (the first sequence of a prompt records them)."""
        parent = self.parents[req.parent_id]
        if req.index != 0 or parent.prompt_logprobs is None:
            return
        for r, entry in enumerate(entries):
            parent.prompt_logprobs[first + r + 1] = self._token_text(entry)

    def add_token(self, req: Request, res: SampleResult, i: int, now: float) -> str | None:
        """Record row ``i`` of ``res`` as ``req``'s new token (already appended to it); the
        stop string its text now ends with, if any (``Request.stop_status`` decides)."""
        parent = self.parents[req.parent_id]
        comp = parent.completions[req.index]
        tok = res.token_ids[i]
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.observe("time_to_first_token_seconds", now - req.arrival_time)
        elif req.last_token_time is not None:
            self.metrics.observe("inter_token_latency_seconds", now - req.last_token_time)
        req.last_token_time = now
        self.metrics.inc("generation_tokens_total")
        if res.logprobs[i] is not None:
            req.cumulative_logprob += res.logprobs[i]  # type: ignore[operator]
            comp.cumulative_logprob = req.cumulative_logprob
            assert comp.logprobs is not None
            comp.logprobs.append(self._token_text(res.top_logprobs[i]))  # type: ignore[arg-type]
        detok = parent.detoks[req.index]
        if detok is None:
            return None
        stop = detok.add_token(tok, req.num_output_tokens >= req.params.min_tokens)
        comp.text = detok.text
        return stop

    def failed(self, request_id: str, error: str, client_error: bool = False) -> RequestOutput | None:
        """The final output of a request that failed (``finish_reason`` 'error'); drops its state."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for comp in parent.completions:
            comp.finish_reason = comp.finish_reason or "error"
        self.metrics.inc("request_failure_total")
        out = self._output(parent)
        out.finished, out.error, out.client_error = True, error, client_error
        return out

    def snapshot(self, parent_ids: set[str], failed: dict[str, str]) -> list[RequestOutput]:
        """RequestOutputs (cumulative) for the given parents; finished ones are dropped. A parent
        whose finishing fails (the final detokenizer flush) goes into ``failed`` instead."""
        outs = []
        for pid in parent_ids:
            parent = self.parents.get(pid)
            if parent is None:
                continue
            try:
                self._update(parent)
            except Exception as e:
                failed[pid] = f"finishing its output failed: {type(e).__name__}: {e}"
                continue
            outs.append(self._output(parent))
            if parent.finished:
                del self.parents[pid]
        return outs

    def _update(self, parent: ParentState) -> None:
        for i, req in enumerate(parent.children):
            comp = parent.completions[i]
            comp.token_ids = list(req.output_token_ids)
            if req.status.finished and not parent.done[i]:
                detok = parent.detoks[i]
                if detok is not None:
                    detok.flush()
                    comp.text = detok.text
                parent.done[i] = True
                comp.finish_reason = req.status.value
                comp.stop_reason = req.stop_reason
                self._finish_metrics(req)

    def _finish_metrics(self, req: Request) -> None:
        now = time.monotonic()
        self.metrics.observe("e2e_request_latency_seconds", now - req.arrival_time)
        if req.scheduled_time is not None:
            self.metrics.observe("request_queue_time_seconds", req.scheduled_time - req.arrival_time)
        self.metrics.inc("request_success_total")

    def _output(self, parent: ParentState) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=parent.completions,
            finished=parent.finished,
        )
