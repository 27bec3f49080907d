"""Paged decode attention and the cache write for an fp32 cache, in C (``csrc/cpu_attention.c``):
they read and write the cache blocks in place."""

from __future__ import annotations

import torch

from qpage.kernels.cpu.native import as_i64, check_decode, load, num_threads, sink_pointer


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, as ``TorchPagedAttention._decode`` computes it (``window``: each row
    attends to its last ``window`` positions, the blocks before them unread; ``softcap``:
    scores soft-capped; ``sinks`` fp32 [H]: one more logit per head in the softmax; as
    ``backends.masked_attention``).

    q: fp32 [n, H, hd] (heads contiguous; sequences may be strided); k_cache/v_cache: fp32
    [num_blocks, block, kvh, hd] contiguous; block_table: int64 [n or 1, >= blocks used]
    (one row: the queries are one prompt chunk's, sharing it);
    seq_lens: int64 [n], each >= 1. Returns fp32 [n, H, hd].
    """
    lib = load()
    assert lib is not None, "paged_decode needs the native kernels; check load() first"
    n, h, hd = q.shape
    nb, bs, kvh, hd_c = k_cache.shape
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32
            or q.stride(2) != 1 or q.stride(1) != hd or hd_c != hd or h % kvh or k_cache.shape != v_cache.shape
            or block_table.shape[0] not in (1, n) or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"paged_decode: unsupported layout q {tuple(q.shape)}/{q.stride()} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}")
    bt, lens = as_i64(block_table), as_i64(seq_lens)
    table_stride = bt.stride(0) if bt.shape[0] == n else 0  # one table row: all queries share it
    out = torch.empty(n, h, hd, dtype=torch.float32)
    rc = lib.qp_paged_decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
                                 table_stride, bt.shape[1], lens.data_ptr(), out.data_ptr(), n, h, kvh, hd, bs, scale,
                                 nb, num_threads(), window or 0, softcap or 0.0, sink_pointer(sinks, h))
    check_decode(rc, "paged_decode", nb)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``write_kv_cache_ref`` for an fp32 cache: k, v fp32 [T, kvh, hd] (each token's heads
    contiguous), slot -1 skipped."""
    lib = load()
    assert lib is not None, "write_kv needs the native kernels; check load() first"
    t, kvh, hd = k.shape
    row = kvh * hd
    ok = all(x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == hd for x in (k, v))
    ok = ok and k.shape == v.shape and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == (kvh, hd)
    if not ok or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != torch.float32:
        raise ValueError("write_kv: unsupported layout or dtype")
    slots = as_i64(slot_mapping)
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.qp_write_kv_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slots.data_ptr(), t, row, n_slots)
    if rc != 0:
        raise ValueError(f"write_kv: a slot outside [-1, {n_slots}) in slot_mapping")
