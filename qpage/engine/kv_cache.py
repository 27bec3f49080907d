"""KV-cache manager: which physical blocks each request owns, and prefix-cache lookups.

The scheduler talks to the cache only through this class and the small ``ComputedBlocks``
result; the block pool below it owns ref counts and eviction order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qpage.config import BLOCK_SIZE
from qpage.engine.block_pool import BlockPool, KVBlock
from qpage.engine.request import Request
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.kv_layout import KVLayout, cdiv
from qpage.models.arch import ArchConfig


def kv_layout(arch: ArchConfig, max_model_len: int) -> KVLayout:
    """The cache layout of ``arch`` run at ``max_model_len`` (``kv_layout``)."""
    return KVLayout.plan(arch.attention_windows(max_model_len))


def plan_capacity(arch: ArchConfig, spec: KVCacheSpec, budget: int, draft_bytes_per_token: int = 0,
                  layout: KVLayout | None = None) -> tuple[int, int]:
    """(blocks, bytes per block) that fit in a KV budget of ``budget`` bytes (scales counted);
    a block holds ``layout.slots`` layers (all of them without a layout); with a draft model
    each block holds its K/V too (``draft_bytes_per_token``)."""
    layers = layout.slots if layout is not None else arch.num_layers
    per_token = spec.bytes_per_token(layers, arch.num_kv_heads, arch.head_dim)
    block_bytes = (per_token + draft_bytes_per_token) * BLOCK_SIZE
    return budget // block_bytes, block_bytes


def model_limit(arch: ArchConfig) -> int:
    """The longest context the model runs: its positions."""
    return arch.max_position_embeddings


def decide_max_model_len(arch: ArchConfig, want: int | None, layout: KVLayout, num_blocks: int, block_bytes: int,
                         chunk: int, budget: object) -> int:
    """The context length: ``want`` (the user's max_model_len) checked against the model's limit
    and the longest request ``num_blocks`` blocks of ``layout`` hold (computing ``chunk``
    tokens a step), or without one the smaller of the two; ValueError naming both numbers and
    the fix (``budget``: kv_cache_memory as the user gave it)."""
    limit = model_limit(arch)
    capacity = layout.max_tokens(num_blocks, chunk, max(limit, want or 0))
    if want is None:
        if capacity < 2:
            raise ValueError(f"kv_cache_memory={budget} holds no block of {block_bytes} bytes; raise kv_cache_memory")
        return min(limit, capacity)
    if want > limit:
        raise ValueError(f"max_model_len={want} exceeds the model's limit of {limit} tokens; lower it")
    if want > capacity:
        need = layout.pages_for(want, chunk) * block_bytes
        raise ValueError(f"max_model_len={want} does not fit the KV cache, which holds {capacity} tokens; "
                         f"raise kv_cache_memory to at least {need} bytes or lower max_model_len")
    return want


@dataclass(frozen=True)
class CachePlan:
    layout: KVLayout
    num_blocks: int
    block_bytes: int
    max_model_len: int
    chunk: int
    """Tokens a step computes at most (``max_num_batched_tokens``)."""

    def describe(self, num_layers: int) -> str:
        """The cache's size for the start line; with local layers, what they save."""
        layout, n = self.layout, self.num_blocks
        if len(layout.groups) == 1:
            return f"{n} blocks x {BLOCK_SIZE} = {n * BLOCK_SIZE} tokens ({self.block_bytes // BLOCK_SIZE} B/token)"
        local = sum(len(g.layers) for g in layout.groups if g.window is not None)
        longest = layout.max_tokens(n, self.chunk, 1 << 30)
        without = n * layout.slots // num_layers * BLOCK_SIZE
        return (f"{n} blocks x {BLOCK_SIZE} tokens x {layout.slots} layers ({self.block_bytes} B); {local} of "
                f"{num_layers} layers keep a {layout.groups[1].window}-token window: one request holds {longest} "
                f"tokens ({without} if they kept every token)")


def plan_cache(arch: ArchConfig, kv_arch: ArchConfig, spec: KVCacheSpec, budget: int, want: int | None,
               chunk: int, draft_bytes: int = 0) -> CachePlan:
    """The layout, blocks and ``max_model_len`` for a KV budget of ``budget`` bytes
    (``kv_arch``: the shape a block is sized for). The layout depends on the
    context length (a window as long as it is no window) and the length on what the layout's
    blocks hold, so a layout that changes with the decided length is planned again."""
    length = want or model_limit(arch)
    for _ in range(2):
        layout = kv_layout(arch, length)
        num_blocks, block_bytes = plan_capacity(kv_arch, spec, budget, draft_bytes, layout)
        length = decide_max_model_len(arch, want, layout, num_blocks, block_bytes, chunk, budget)
        if kv_layout(arch, length) == layout:
            break
    return CachePlan(layout, num_blocks, block_bytes, length, chunk)


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: per group of the layout, the blocks whose KV is already computed
    (None where a local group's window no longer reaches), and how many tokens they hold."""

    tables: list[list[KVBlock | None]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tables[0]) * BLOCK_SIZE if self.tables else 0


class KVCacheManager:
    """Per request, one block table per group of the KV layout (``kv_layout``), all from one
    pool. A local group's blocks that its window no longer reaches are given back as the
    request moves on (they stay in the prefix cache until evicted) and read as block 0 in its
    table, which the attention masks out. Prefix-cache entries are per group."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, layout: KVLayout | None = None) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.windows = [g.window for g in layout.groups] if layout is not None else [None]
        self._blocks: dict[str, list[list[KVBlock | None]]] = {}
        self._num_cached: dict[str, int] = {}
        self._released: dict[str, int] = {}
        """Per request, the logical blocks below which its local groups' blocks are given back."""
        self.table_entries = 0
        """Blocks in the requests' tables, given-back ones included: what a cache without
        windows would hold for them."""
        self.held_entries = 0
        """Of which held (not given back)."""
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group (block 0 where a block was given back)."""
        return [[0 if b is None else b.block_id for b in t] for t in self._blocks.get(request_id, [[]])]

    def block_ids(self, request_id: str) -> list[int]:
        """The block table of a one-group layout."""
        assert len(self.windows) == 1, "a layout of several groups has a table per group: block_tables"
        return self.block_tables(request_id)[0]

    def _key(self, group: int, block_hash: bytes) -> bytes:
        """The prefix-cache key of a block's content in ``group`` (the hash itself in group 0)."""
        return block_hash if group == 0 else bytes([group]) + block_hash

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request, leaving at least its last token to compute: the
        blocks of a global group, and of each local group only those the next token's window
        reaches (None before them)."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return ComputedBlocks()
        max_blocks = (request.num_tokens - 1) // BLOCK_SIZE
        hashes = request.block_hashes[:max_blocks]
        self.prefix_queries += request.num_tokens
        full: list[KVBlock] | None = None
        if self.windows[0] is None:  # a global group: its longest cached chain bounds the hit
            full = []
            for h in hashes:
                block = self.pool.get_cached_block(h)
                if block is None:
                    break
                full.append(block)
        for n in range(len(hashes) if full is None else len(full), 0, -1):
            tables: list[list[KVBlock | None]] = []
            for g, window in enumerate(self.windows):
                table = list(full[:n]) if g == 0 and full is not None else self._window_blocks(g, window, hashes, n)
                if table is None:
                    break
                tables.append(table)
            else:
                self.prefix_hits += n * BLOCK_SIZE
                return ComputedBlocks(tables)
        return ComputedBlocks()

    def _window_blocks(self, g: int, window: int | None, hashes: list[bytes], n: int) -> list[KVBlock | None] | None:
        """Local group ``g``'s table for a hit of ``n`` blocks (None before the blocks the next
        token's window reaches), or None when one of those is not cached (its last first)."""
        assert window is not None, "only the first group of a layout is global"
        first = max(0, n * BLOCK_SIZE - window + 1) // BLOCK_SIZE
        if self.pool.get_cached_block(self._key(g, hashes[n - 1])) is None:
            return None
        table: list[KVBlock | None] = [None] * first
        for h in hashes[first:n]:
            block = self.pool.get_cached_block(self._key(g, h))
            if block is None:
                return None
            table.append(block)
        return table

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens, or None if they don't fit.

        ``computed`` is a prefix hit for a request that has no blocks yet; its blocks are
        taken (ref count +1) before new ones are handed out. Blocks of local groups that the
        new tokens' windows no longer reach are given back first. Returns the new block ids.
        """
        rid = request.request_id
        owned = self._blocks.setdefault(rid, [[] for _ in self.windows])
        hits = computed.tables if computed is not None and computed.tables else [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + len(hits[0]) * BLOCK_SIZE
        total = num_computed + num_new_tokens
        self._release(rid, owned, num_computed)
        blocks = cdiv(total, BLOCK_SIZE)
        need = [max(blocks - len(o) - len(h), 0) for o, h in zip(owned, hits, strict=True)]
        # Hit blocks that sit in the free queue stop being free once touched.
        hit_free = sum(1 for h in hits for b in h if b is not None and b.ref_cnt == 0)
        if sum(need) > self.pool.num_free_blocks - hit_free:
            if not any(owned):
                del self._blocks[rid]
            return None
        new_ids: list[int] = []
        for o, h, n in zip(owned, hits, need, strict=True):
            touched = [b for b in h if b is not None]
            self.pool.touch(touched)
            o.extend(h)
            new = self.pool.allocate(n)
            o.extend(new)
            new_ids.extend(b.block_id for b in new)
            self.table_entries += len(h) + n
            self.held_entries += len(touched) + n
        if self.enable_caching:
            self._cache_full_blocks(request, owned, total)
        return new_ids

    def _release(self, rid: str, owned: list[list[KVBlock | None]], num_computed: int) -> None:
        """Give back local groups' blocks wholly before the window of the token at ``num_computed``."""
        start = self._released.get(rid, 0)
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            end = min(max(0, num_computed - window + 1) // BLOCK_SIZE, len(owned[g]))
            for i in range(start, end):
                block = owned[g][i]
                if block is not None:
                    self.pool.free([block])
                    owned[g][i] = None
                    self.held_entries -= 1
            self._released[rid] = max(start, end)

    def _cache_full_blocks(self, request: Request, owned: list[list[KVBlock | None]], total: int) -> None:
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        end = min(total // BLOCK_SIZE, len(request.block_hashes))
        for g, table in enumerate(owned):
            for i in range(start, end):
                block = table[i]
                if block is not None:
                    self.pool.cache_block(block, self._key(g, request.block_hashes[i]))
        self._num_cached[rid] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        tables = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        for table in tables:
            held = [b for b in reversed(table) if b is not None]
            self.pool.free(held)
            self.table_entries -= len(table)
            self.held_entries -= len(held)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
