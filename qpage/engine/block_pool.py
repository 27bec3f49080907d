"""The pool of physical KV blocks: ref counts, an LRU free queue and the prefix-cache map.

Invariants (checked by ``check_invariants`` in tests):
- a block is in the free queue iff its ref count is 0;
- a block with a hash is in the hash map under that hash, and nowhere else;
- freed blocks keep their hash until they are handed out again, so they stay hittable;
- blocks are handed out from the head of the free queue (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict keyed by block id is the LRU queue: O(1) pop from the head,
        # append at the tail and removal from the middle (when a free cached block is hit).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Share of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference on each block, in the given order; blocks reaching 0 go to the tail."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins for duplicate content)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # identical content already cached in another block
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget all hashes; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} free/ref mismatch"
            assert block.ref_cnt >= 0
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block
        for h, block in self._cached.items():
            assert block.block_hash == h
