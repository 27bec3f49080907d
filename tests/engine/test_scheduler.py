"""Scheduler without a model: token budget, decodes first, chunked prefill, preemption."""

from __future__ import annotations

from qpage.config import SchedulerConfig
from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request, RequestStatus
from qpage.engine.scheduler import Scheduler
from qpage.runner.batch import SchedulerOutput
from qpage.sampling_params import SamplingParams


def req(rid: str, n: int, max_tokens: int = 50) -> Request:
    return Request(rid, list(range(1000 * int(rid[1:]), 1000 * int(rid[1:]) + n)),
                   SamplingParams(max_tokens=max_tokens), max_tokens, {999999})


MAX_MODEL_LEN = 4096


def advance(s: Scheduler, out: SchedulerOutput, kept: dict[str, list[int]] | None = None) -> list[Request]:
    """What the engine does after a step: append each sampling request's tokens (``kept``, else
    one 7), end the requests whose stop decision says so; return those."""
    ended = []
    sampled = [x.request for x in out.scheduled if x.samples]
    tokens = {r.request_id: (kept or {}).get(r.request_id, [7]) for r in sampled}
    s.update(out, {rid: len(t) for rid, t in tokens.items()})
    for r in sampled:
        assert isinstance(r, Request)
        for t in tokens[r.request_id]:
            r.append_token(t)
        status = r.stop_status(MAX_MODEL_LEN)
        if status is not None:
            s.finish(r, status)
            ended.append(r)
    return ended


def run_step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    advance(s, out)
    return {x.request.request_id: x.num_tokens for x in out.scheduled}


def test_chunked_prefill_within_budget_and_decodes_first() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), KVCacheManager(64))
    s.add_request(req("r1", 50))
    assert run_step(s) == {"r1": 32}  # first chunk
    s.add_request(req("r2", 40))
    assert run_step(s) == {"r1": 18, "r2": 14}  # r1 finishes its prompt first
    assert run_step(s) == {"r1": 1, "r2": 26}  # r1 decodes, r2 gets the rest of the budget
    assert run_step(s) == {"r1": 1, "r2": 1}
    assert s.running[0].num_output_tokens == 3


def test_max_num_seqs_caps_running() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512), KVCacheManager(64))
    for i in range(1, 4):
        s.add_request(req(f"r{i}", 10))
    assert set(run_step(s)) == {"r1", "r2"}
    assert [r.request_id for r in s.waiting] == ["r3"]


def test_preemption_by_recompute_newest_first_and_everyone_finishes() -> None:
    # 6 blocks = 96 tokens; three requests of 30-token prompts growing to 60 cannot all fit.
    kv = KVCacheManager(6, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), kv)
    reqs = [req(f"r{i}", 30, max_tokens=30) for i in range(1, 4)]
    for r in reqs:
        s.add_request(r)
    finished, steps = [], 0
    while s.has_unfinished() and steps < 500:
        out = s.schedule()
        if out.preempted:
            # The newest running request is the victim, sent to the front of the queue.
            assert s.waiting[0].request_id == out.preempted[-1]
            assert s.waiting[0].num_computed_tokens == 0
        finished += advance(s, out)
        kv.pool.check_invariants()
        steps += 1
    assert s.num_preemptions > 0
    assert sorted(r.request_id for r in finished) == ["r1", "r2", "r3"]
    assert all(r.num_output_tokens == 30 and r.status == RequestStatus.FINISHED_LENGTH for r in finished)
    assert kv.pool.num_free_blocks == 6


def test_finish_frees_blocks_of_waiting_and_running() -> None:
    kv = KVCacheManager(8)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), kv)
    a, b = req("r1", 20), req("r2", 20)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and kv.pool.num_free_blocks == 8


def test_drafts_use_only_what_is_left_and_count_only_kept_tokens() -> None:
    # 5 blocks of 16 tokens: r1 (30 prompt tokens) and r2 (31) hold 2 each and decode in them.
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(5, enable_caching=False))
    s.add_request(req("r1", 30))
    s.add_request(req("r2", 31))
    run_step(s)  # both prompts; each samples its first token
    r1, r2 = s.running
    r1.draft_token_ids, r2.draft_token_ids = [1, 2, 3], [4, 5]
    out = s.schedule()
    # r1's drafts take the free block; r2's would need one more: it decodes alone, and nobody is preempted.
    assert {x.request.request_id: (x.num_tokens, x.draft_token_ids) for x in out.scheduled} == {
        "r1": (4, [1, 2, 3]), "r2": (1, [])}
    assert not out.preempted and r1.draft_token_ids == [] and r2.draft_token_ids == []
    advance(s, out, {"r1": [1, 9], "r2": [8]})  # r1 kept one draft and a token of its own
    assert (r1.num_computed_tokens, r1.num_tokens) == (32, 33)
    assert (r2.num_computed_tokens, r2.num_tokens) == (32, 33)
    # The budget left after every running request's own token caps the drafts.
    s2 = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3), KVCacheManager(8))
    s2.add_request(req("r1", 3))
    run_step(s2)
    s2.running[0].draft_token_ids = [1, 2, 3, 4]
    assert [(x.num_tokens, x.draft_token_ids) for x in s2.schedule().scheduled] == [(3, [1, 2])]
