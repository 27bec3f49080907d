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
from qpage.models.arch import ArchConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_capacity(arch: ArchConfig, spec: KVCacheSpec, budget: int, draft_bytes_per_token: int = 0) -> tuple[int, int]:
    """(blocks, bytes per block) that fit in a KV budget of ``budget`` bytes (scales counted);
    with a draft model each block holds its K/V too (``draft_bytes_per_token``)."""
    per_token = spec.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim)
    block_bytes = (per_token + draft_bytes_per_token) * BLOCK_SIZE
    return budget // block_bytes, block_bytes


def decide_max_model_len(arch: ArchConfig, want: int | None, capacity: int, block_bytes: int,
                         budget: object) -> int:
    """The context length: ``want`` (the user's max_model_len) checked against the model's limit
    and the cache's ``capacity`` in tokens, or without one the smaller of the two; ValueError
    naming both numbers and the fix (``budget``: kv_cache_memory as the user gave it)."""
    limit = arch.max_position_embeddings
    if arch.uniform_window:  # every layer windowed: the C kernels attend to whole contexts
        limit = min(limit, arch.uniform_window)
    if want is None:
        if capacity < 2:
            raise ValueError(f"kv_cache_memory={budget} holds no block of {block_bytes} bytes; raise kv_cache_memory")
        return min(limit, capacity)
    if want > limit:
        raise ValueError(f"max_model_len={want} exceeds the model's limit of {limit} tokens; lower it")
    if want > capacity:
        need = cdiv(want, BLOCK_SIZE) * block_bytes
        raise ValueError(f"max_model_len={want} does not fit the KV cache, which holds {capacity} tokens; "
                         f"raise kv_cache_memory to at least {need} bytes or lower max_model_len")
    return want


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: blocks whose KV is already computed, and how many tokens they hold."""

    blocks: list[KVBlock] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * BLOCK_SIZE


class KVCacheManager:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request, leaving at least its last token to compute."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return ComputedBlocks()
        max_blocks = (request.num_tokens - 1) // BLOCK_SIZE
        hit: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hit) * BLOCK_SIZE
        return ComputedBlocks(hit)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens, or None if they don't fit.

        ``computed`` is a prefix hit for a request that has no blocks yet; its blocks are
        taken (ref count +1) before new ones are handed out.
        """
        rid = request.request_id
        owned = self._blocks.setdefault(rid, [])
        hit = computed.blocks if computed is not None else []
        num_computed = request.num_computed_tokens + len(hit) * BLOCK_SIZE
        total = num_computed + num_new_tokens
        need = max(cdiv(total, BLOCK_SIZE) - len(owned) - len(hit), 0)
        # Hit blocks that sit in the free queue stop being free once touched.
        hit_free = sum(1 for b in hit if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - hit_free:
            if not owned:
                del self._blocks[rid]
            return None
        self.pool.touch(hit)
        owned.extend(hit)
        new = self.pool.allocate(need)
        owned.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, owned, total)
        return [b.block_id for b in new]

    def _cache_full_blocks(self, request: Request, owned: list[KVBlock], total: int) -> None:
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        end = min(total // BLOCK_SIZE, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(owned[i], request.block_hashes[i])
        self._num_cached[rid] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
