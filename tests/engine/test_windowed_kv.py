"""The KV layout of a model with sliding-window layers beside global ones, and the manager's
per-group block tables: exact blocks given back as the window moves on, prefix hits that need
only the window's blocks in local groups, and every block accounted for.

Layout under test: 6 layers, layer 5 global and 0-4 local (Gemma 3's pattern) with a 40-token
window, so one global group of one layer and five local groups of one layer each.
"""

from __future__ import annotations

import pytest

from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request
from qpage.layers.attention.kv_layout import KVGroup, KVLayout
from qpage.sampling_params import SamplingParams

WINDOW = 40
LAYOUT = KVLayout.plan([WINDOW] * 5 + [None])


def make_req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(), 100, set())


def test_layout_groups_local_layers_as_many_as_the_global_ones() -> None:
    assert LAYOUT.groups[0] == KVGroup(None, (5,))
    assert [g.layers for g in LAYOUT.groups[1:]] == [(0,), (1,), (2,), (3,), (4,)]
    assert LAYOUT.slots == 1
    twelve = KVLayout.plan([None if (i + 1) % 6 == 0 else 1024 for i in range(12)])  # 2 global, 10 local
    assert twelve.slots == 2 and [g.layers for g in twelve.groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8),
                                                                       (9, 10)]
    assert twelve.slot_of()[7] == (4, 0) and twelve.slot_of()[11] == (0, 1)
    alike = KVLayout.plan([None] * 4)
    assert len(alike.groups) == 1 and alike.slots == 4
    # A request of 8 windows holds 8 windows' blocks in the global group and about one window in each local.
    assert LAYOUT.pages_for(320, 16) == 20 + 5 * 5


def test_local_blocks_are_given_back_as_the_window_moves() -> None:
    kv = KVCacheManager(64, enable_caching=False, layout=LAYOUT)
    req = make_req("a", list(range(100)))
    assert kv.allocate_slots(req, 100) is not None  # one prefill chunk: every block needed
    assert [len(t) for t in kv.block_tables("a")] == [7] * 6
    assert kv.held_entries == kv.table_entries == 42
    req.num_computed_tokens = 100
    assert kv.allocate_slots(req, 1) is not None
    # The token at 100 sees 61..100: blocks 3..6 (tokens 48..111); 0-2 of each local group go back.
    tables = kv.block_tables("a")
    assert tables[0] == sorted(set(tables[0])) and 0 not in tables[0][1:]
    for t in tables[1:]:
        assert t[:3] == [0, 0, 0] and 0 not in t[3:]
    assert (kv.held_entries, kv.table_entries) == (7 + 5 * 4, 42)
    assert kv.pool.num_free_blocks == 64 - 27
    kv.free(req)
    assert kv.pool.num_free_blocks == 64 and kv.held_entries == kv.table_entries == 0
    kv.pool.check_invariants()


def test_prefix_hit_needs_only_the_window_in_local_groups() -> None:
    kv = KVCacheManager(80, layout=LAYOUT)
    prompt = list(range(130))
    first = make_req("a", prompt)
    assert kv.allocate_slots(first, 130) is not None
    first.num_computed_tokens = 130
    assert kv.allocate_slots(first, 1) is not None  # gives back local blocks 0-4 (they stay cached)
    kv.free(first)
    second = make_req("b", [*prompt, 7])
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 128  # 8 whole blocks
    # Local groups: the next token (128) sees 89..128, blocks 5..7; earlier ones are not needed.
    for table in hit.tables[1:]:
        assert table[:5] == [None] * 5 and all(b is not None for b in table[5:])
    assert kv.allocate_slots(second, 3, hit) is not None
    assert kv.held_entries == 9 + 5 * 4 and kv.table_entries == 6 * 9
    kv.pool.check_invariants()


def test_no_prefix_hit_without_the_local_windows() -> None:
    """The global group's blocks alone are no hit: local layers need their window's K/V."""
    kv = KVCacheManager(6 * 13 + 2, layout=LAYOUT)
    first = make_req("a", list(range(200)))  # 13 blocks in each of the 6 groups
    assert kv.allocate_slots(first, 200) is not None
    first.num_computed_tokens = 200
    assert kv.allocate_slots(first, 1) is not None  # local blocks 0-9 go back to the free queue, cached
    assert kv.get_computed_blocks(make_req("b", [*range(96), 999])).num_tokens == 96
    other = make_req("x", list(range(1000, 1080)))  # 30 blocks: the 2 unused, then local groups 1-3's
    assert kv.allocate_slots(other, 80) is not None
    assert kv.get_computed_blocks(make_req("c", [*range(96), 999])).num_tokens == 0
    kv.pool.check_invariants()


def test_a_hit_on_a_windowed_only_layout_takes_only_the_window() -> None:
    """Every layer windowed (one group, Mistral's case): a hit takes the blocks the next token's
    window reaches, not the whole cached prefix, so a small pool still admits the request."""
    layout = KVLayout.plan([WINDOW, WINDOW])
    assert [g.window for g in layout.groups] == [WINDOW]
    kv = KVCacheManager(12, layout=layout)
    first = make_req("a", list(range(320)))
    for start in range(0, 320, 16):  # a chunked prefill: the window moves on, early blocks go back
        first.num_computed_tokens = start
        assert kv.allocate_slots(first, 16) is not None
    kv.free(first)
    second = make_req("b", [*range(304), *range(1000, 1050)])
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 304
    assert hit.tables[0][:16] == [None] * 16 and all(b is not None for b in hit.tables[0][16:])
    assert kv.allocate_slots(second, 50, hit) is not None  # 3 hit blocks and 4 new in a pool of 12
    kv.pool.check_invariants()


@pytest.mark.parametrize("window", [1, 16, 17, 40])
def test_live_blocks_bound_holds_for_every_position(window: int) -> None:
    layout = KVLayout.plan([window, None])
    kv = KVCacheManager(200, enable_caching=False, layout=layout)
    req = make_req("a", list(range(300)))
    assert kv.allocate_slots(req, 1) is not None
    for n in range(1, 300):
        req.num_computed_tokens = n
        assert kv.allocate_slots(req, 1) is not None
        held = kv.held_entries - len(kv.block_tables("a")[0])
        assert held <= layout.live_blocks(window, n + 1, 1)
