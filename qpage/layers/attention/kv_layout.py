"""How the paged KV cache is laid out over a model's layers: groups of layers that share block
tables, and the pages that hold them.

A model whose layers all attend to their whole context has one group of every layer: a block
id names the K/V of 16 tokens in every layer, as in vLLM. A model with sliding-window layers
beside global ones (Gemma 2/3) has a group of its global layers and groups of its local
layers, each group as many layers as the global one (the last may have fewer): a page holds
``slots`` layers' K/V of 16 tokens, and a block id names one page of one group. Layer i of
each group reads and writes the i-th slot tensor. Every request holds one block table per
group; a local group keeps only the blocks its window still reaches, so a long context holds
``1/num_groups`` of a full cache's pages plus a window's worth per local group (vLLM's hybrid
allocator). Pages come from one pool, so local and global groups share the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from qpage.config import BLOCK_SIZE


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    window: int | None
    """The layers attend to their last ``window`` positions (None: the whole context)."""
    layers: tuple[int, ...]
    """Model layer indices; the j-th uses slot tensor j."""


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int
    """Layers per page: the slot tensors the runner allocates."""

    @staticmethod
    def plan(windows: list[int | None]) -> KVLayout:
        """The layout for per-layer windows (None: global; a window as long as the context is
        no window): one group when every layer is alike, else the global layers and the local
        ones in groups of as many."""
        n = len(windows)
        local = [i for i, w in enumerate(windows) if w is not None]
        full = [i for i, w in enumerate(windows) if w is None]
        if not local or not full:
            return KVLayout((KVGroup(windows[0] if local else None, tuple(range(n))),), n)
        if len({windows[i] for i in local}) != 1:
            raise ValueError("local layers with different windows are not supported")
        size = len(full)
        groups = [KVGroup(None, tuple(full))]
        groups += [KVGroup(windows[local[0]], tuple(local[k : k + size])) for k in range(0, len(local), size)]
        return KVLayout(tuple(groups), size)

    def slot_of(self) -> list[tuple[int, int]]:
        """(group, slot) of each model layer."""
        out: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return [out[i] for i in range(len(out))]

    def live_blocks(self, window: int | None, tokens: int, chunk: int) -> int:
        """Blocks one request of ``tokens`` holds in a group with ``window`` while computing
        up to ``chunk`` tokens a step (a local group holds the window behind the chunk)."""
        full = cdiv(tokens, BLOCK_SIZE)
        return full if window is None else min(full, cdiv(window - 1 + chunk, BLOCK_SIZE) + 1)

    def pages_for(self, tokens: int, chunk: int) -> int:
        """Pages one request of ``tokens`` holds at most."""
        return sum(self.live_blocks(g.window, tokens, chunk) for g in self.groups)

    def max_tokens(self, pages: int, chunk: int, limit: int) -> int:
        """The longest request (up to ``limit`` tokens) that ``pages`` hold."""
        lo, hi = 0, limit
        while lo < hi:  # pages_for is monotone in tokens
            mid = (lo + hi + 1) // 2
            if self.pages_for(mid, chunk) <= pages:
                lo = mid
            else:
                hi = mid - 1
        return lo
