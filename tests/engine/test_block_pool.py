"""Block pool and KV-cache manager: exact block ids, eviction order, prefix hits, and a
property test that no block is ever lost or double-owned."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qpage.config import BLOCK_SIZE
from qpage.engine.block_pool import BlockPool
from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request
from qpage.sampling_params import SamplingParams


def make_req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(), 100, set())


def test_allocate_takes_lowest_ids_then_freed_go_to_tail() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3]
    assert pool.free_block_ids() == [4, 5]
    pool.free(list(reversed(a)))  # a request frees tail first
    assert pool.free_block_ids() == [4, 5, 1, 0]
    assert [x.block_id for x in pool.allocate(3)] == [4, 5, 1]
    pool.check_invariants()


def test_cached_block_stays_hittable_until_evicted() -> None:
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"h0")
    pool.free([blk])
    assert pool.get_cached_block(b"h0") is blk  # free but still cached
    pool.touch([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_block_ids()
    pool.free([blk])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.allocate(3)  # reuses block 0 last, evicting its hash
    assert pool.get_cached_block(b"h0") is None
    pool.check_invariants()


def test_prefix_hit_exact_blocks_and_cap_at_last_token() -> None:
    kv = KVCacheManager(10)
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    r1 = make_req("r1", prompt)
    assert kv.allocate_slots(r1, 40) == [0, 1, 2]
    r1.num_computed_tokens = 40
    # Same prompt: both full blocks hit, the partial third is computed again.
    r2 = make_req("r2", prompt)
    hit = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hit.tables[0]] == [0, 1]
    assert kv.allocate_slots(r2, 40 - hit.num_tokens, hit) == [3]
    assert kv.block_ids("r2") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    # A prompt of exactly 2 blocks hits only 1: the last token must be computed for logits.
    r3 = make_req("r3", list(range(32)))
    assert len(kv.get_computed_blocks(r3).tables[0]) == 1
    assert kv.prefix_hits == 2 * BLOCK_SIZE + BLOCK_SIZE
    kv.free(r1)
    kv.free(r2)
    # r2 freed [3, 1, 0] after r1's [2, 1, 0]: ref counts reach 0 in r2's order for 1 and 0.
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.pool.check_invariants()


def test_allocate_refuses_when_full_without_side_effects() -> None:
    kv = KVCacheManager(2)
    r1 = make_req("r1", list(range(20)))
    assert kv.allocate_slots(r1, 20) == [0, 1]
    r2 = make_req("r2", list(range(100, 105)))
    assert kv.allocate_slots(r2, 5) is None
    assert kv.block_ids("r2") == []
    kv.pool.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7),
                          st.integers(1, 40), st.integers(0, 3)), max_size=60))
def test_random_allocate_free_cache_keeps_every_block_accounted(ops: list) -> None:
    kv = KVCacheManager(12)
    live: dict[str, Request] = {}
    for op, slot, n, prefix in ops:
        rid = f"r{slot}"
        if op == "add" and rid not in live:
            # Shared prefixes (by `prefix`) make hits and shared blocks likely.
            req = make_req(rid, [prefix] * 24 + list(range(slot * 100, slot * 100 + n)))
            hit = kv.get_computed_blocks(req)
            todo = req.num_tokens - hit.num_tokens
            if kv.allocate_slots(req, todo, hit) is not None:
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
        elif op == "grow" and rid in live:
            req = live[rid]
            for t in range(n):
                req.append_token(t)
            if kv.allocate_slots(req, n) is not None:
                req.num_computed_tokens += n
            else:
                kv.free(req)
                del live[rid]
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        kv.pool.check_invariants()
        owners: dict[int, int] = {}
        for req in live.values():
            ids = kv.block_ids(req.request_id)
            assert len(ids) == len(set(ids)), "a request owns a block twice"
            assert len(ids) == -(-req.num_computed_tokens // BLOCK_SIZE)
            for b in ids:
                owners[b] = owners.get(b, 0) + 1
        for b in kv.pool.blocks:
            assert b.ref_cnt == owners.get(b.block_id, 0), f"block {b.block_id} ref count wrong"
        assert kv.pool.num_free_blocks + len(owners) == 12, "a block was lost"
    for req in list(live.values()):
        kv.free(req)
    assert kv.pool.num_free_blocks == 12
