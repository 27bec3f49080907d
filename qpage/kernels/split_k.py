"""Split-K for the weight-streaming matmuls: partial sums over slices of K, then one sum.

At decode batch sizes a matmul is bound by reading the weight once, so it needs many
programs in flight; when N alone gives too few output tiles, the K loop is split over
SPLIT_K programs per tile. Each program stores its fp32 partial tile in a workspace and
bumps the tile's counter; the program that arrives last sums the SPLIT_K partials in a
fixed order, writes the output in its final dtype and resets the counter. One launch, no
memset, no cast kernel afterwards, and a deterministic result. The counters live in a
per-device int32 buffer that is zero between launches (each last program clears its own),
so launches that share it must not overlap: one stream, as the engine runs.

Memory ordering: all threads' workspace stores are ordered before the
counter's release by a CTA barrier; the last program's acquire orders its workspace loads
after the others' stores, and those loads bypass L1 (``.cg``), which is not coherent.
"""

import torch

from qpage.kernels.triton_utils import tl, triton


@triton.jit
def split_k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [start, end) that split ``pid_k`` of SPLIT_K reduces (the last may be short)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_start = pid_k * per_split
    t_end = t_start + per_split
    if t_end > k_tiles:
        t_end = k_tiles
    return t_start, t_end


@triton.jit
def finish_split_k(acc, y_ptrs, mask, local, ws_ptr, lock_ptr, tile, num_tiles, pid_k,
                   TILE: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write a program's fp32 ``acc`` to ``y_ptrs``: directly when K is not split, else
    through the workspace by the last of the SPLIT_K programs (module docstring). ``local`` indexes ``acc``'s
    elements within its tile (0..TILE), ``tile`` the tile among ``num_tiles``."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * num_tiles + tile) * TILE + local, acc, mask=mask)  # real rows only
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + (s * num_tiles + tile) * TILE + local, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def finish_tile(acc, y_ptr, offs_m, offs_n, mask, stride_ym, stride_yn, ws_ptr, lock_ptr, pid_m, pid_n, pid_k,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """``finish_split_k`` for a [BLOCK_M, BLOCK_N] output tile of a (pid_m, pid_n, pid_k) grid."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    finish_split_k(acc, y_ptrs, mask, local, ws_ptr, lock_ptr, pid_m * tl.num_programs(1) + pid_n,
                   tl.num_programs(0) * tl.num_programs(1), pid_k, BLOCK_M * BLOCK_N, SPLIT_K)


_LOCKS: dict[torch.device, torch.Tensor] = {}


def tile_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """The per-device counter buffer (zeros between launches), grown to at least ``tiles``."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < tiles:
        locks = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def split_k_output(m: int, n: int, dtype: torch.dtype, device: torch.device, split: int, tiles: int,
                   tile_elems: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, workspace, locks) for a launch of ``tiles`` output tiles of ``tile_elems`` each;
    without a split the workspace and locks are placeholders (never read)."""
    y = torch.empty((m, n), dtype=dtype, device=device)
    if split == 1:
        return y, y, y
    ws = torch.empty(split * tiles * tile_elems, dtype=torch.float32, device=device)
    return y, ws, tile_locks(device, tiles)
