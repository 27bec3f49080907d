"""Continuous-batching scheduler: one token budget, running requests first, chunked prefill.

There are no prefill and decode phases. Each request has ``num_computed_tokens``; each step
gives every running request the tokens it still needs (1 for a decode, a chunk for an
unfinished prompt), then admits waiting requests, all within ``max_num_batched_tokens`` and
``max_num_seqs``. When a running request cannot get a block, the newest running request is
preempted by recompute: its blocks are freed and it goes back to the front of the queue
(its blocks usually come back as prefix-cache hits).

Speculative decoding adds a decoding request's draft tokens (``Request.draft_token_ids``) after
every running request has its own tokens, from the budget and free blocks left, so drafts never
preempt anyone; after the step the rejected drafts' slots are simply not counted as computed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import cast

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
        budget = self._add_drafts(budget, out)
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        """``req`` runs ``n`` tokens on the blocks just allocated to it (a later preemption in
        the same step takes only requests scheduled after it, so its table holds)."""
        return ScheduledRequest(req, n, req.num_computed_tokens + n >= req.num_tokens,
                                self.kv.block_tables(req.request_id))

    def _add_drafts(self, budget: int, out: SchedulerOutput) -> int:
        """Extend each scheduled decode by its drafts where the budget and free blocks allow."""
        for s in out.scheduled:
            req = cast(Request, s.request)
            drafts, req.draft_token_ids = req.draft_token_ids, []
            k = min(len(drafts), budget)
            if k and s.num_tokens == 1 and s.samples and self.kv.allocate_slots(req, 1 + k) is not None:
                s.draft_token_ids = drafts[:k]
                s.num_tokens += k
                s.block_tables = self.kv.block_tables(req.request_id)
                budget -= k
        return budget

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
        req.draft_token_ids = []
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
    def update(self, out: SchedulerOutput, emitted: dict[str, int]) -> None:
        """Advance every scheduled request's progress after a model step. ``emitted``: the
        tokens each sampling request got (1, or with drafts the accepted ones plus one); only
        the accepted drafts' K/V count as computed, the rest are overwritten later. The engine
        appends the tokens (``Request.append_token``) and ends requests (``finish``)."""
        for s in out.scheduled:
            accepted = emitted.get(s.request.request_id, 1) - 1 if s.draft_token_ids else 0
            s.request.num_computed_tokens += s.num_tokens - len(s.draft_token_ids) + accepted
