"""Continuous-batching scheduler: one token budget, running requests first, chunked prefill.

There are no prefill and decode phases. Each request has ``num_computed_tokens``; each step
gives every running request the tokens it still needs (1 for a decode, a chunk for an
unfinished prompt), then admits waiting requests, all within ``max_num_batched_tokens`` and
``max_num_seqs``. When a running request cannot get a block, the newest running request is
preempted by recompute: its blocks are freed and it goes back to the front of the queue
(its blocks usually come back as prefix-cache hits).
"""

from __future__ import annotations

import time
from collections import deque

from qpage.config import SchedulerConfig
from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request, RequestStatus
from qpage.runner.batch import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request early (stop string, abort): free its blocks, drop it from the queues."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted: everything after it is gone too
            out.scheduled.append(self._entry(req, n))
            budget -= n
            i += 1
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        """``req`` runs ``n`` tokens on the blocks just allocated to it (a later preemption in
        the same step takes only requests scheduled after it, so its table holds)."""
        return ScheduledRequest(req, n, req.num_computed_tokens + n >= req.num_tokens,
                                list(self.kv.block_ids(req.request_id)))

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(req, n) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate_slots(req, n, hit) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            if req.scheduled_time is None:
                req.scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._entry(req, n))
            budget -= n
        return budget

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance every scheduled request's progress after a model step and append its
        sampled token; return the requests that got one (``Request.stop_status`` then says
        whether each ends, and ``finish`` ends it)."""
        grew = []
        for s in out.scheduled:
            req: Request = s.request  # type: ignore[assignment]  # the scheduler's own requests
            req.num_computed_tokens += s.num_tokens
            if s.samples:
                req.append_token(sampled[req.request_id])
                grew.append(req)
        return grew
