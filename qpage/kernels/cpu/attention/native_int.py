"""The int8/int4 KV cache kernels in C (``csrc/cpu_int.c``): the cache write of K or V,
bit-exact with ``kv_int.write_int_cache_ref``; paged decode attention reading the codes in place, as
``TorchPagedAttention._decode`` computes it on the dequantized cache; and a block
dequantizer that feeds prefill over the paged context. Layout: ``kernels.kv_int``.
"""

from __future__ import annotations

import torch

from qpage.kernels.cpu.native import as_i64, check_decode, load, num_threads, sink_pointer
from qpage.kernels.kv_int import PARAMS, code_width


def _check_cache(cache: torch.Tensor, params: torch.Tensor, bits: int, head_dim: int) -> None:
    nb, bs, kvh, width = cache.shape
    want = torch.int8 if bits == 8 else torch.uint8
    if (bits not in PARAMS or cache.dtype != want or width != code_width(bits, head_dim) or not cache.is_contiguous()
            or params.dtype != torch.float16 or tuple(params.shape) != (nb, bs, kvh, PARAMS[bits])
            or not params.is_contiguous() or (bits == 4 and head_dim % 2)):
        raise ValueError(
            f"int{bits} cache: expected contiguous {want} codes [.., {code_width(bits, head_dim)}] and fp16 "
            f"parameters [{nb}, {bs}, {kvh}, {PARAMS.get(bits)}] (int4: an even head_dim), got {cache.dtype} "
            f"{tuple(cache.shape)}, {params.dtype} {tuple(params.shape)}, head_dim {head_dim}")


def write_int(x: torch.Tensor, cache: torch.Tensor, params: torch.Tensor, slot_mapping: torch.Tensor,
              bits: int) -> None:
    """``write_int_cache_ref`` for K or V: x fp32 [T, kvh, hd] (heads contiguous)."""
    lib = load()
    assert lib is not None, "write_int needs the native kernels; check load() first"
    t, kvh, hd = x.shape
    _check_cache(cache, params, bits, hd)
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != hd or cache.shape[2] != kvh:
        raise ValueError(f"write_int: unsupported rows {tuple(x.shape)} {x.dtype} for cache {tuple(cache.shape)}")
    slots = as_i64(slot_mapping)
    num_slots = cache.shape[0] * cache.shape[1]
    if lib.qp_write_int(x.data_ptr(), x.stride(0), cache.data_ptr(), params.data_ptr(), slots.data_ptr(), t, kvh, hd,
                        num_slots, bits) != 0:
        raise ValueError(f"write_int: a slot outside [-1, {num_slots}) in slot_mapping")


def paged_decode_int(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_params: torch.Tensor, v_params: torch.Tensor,
    k_bits: int, v_bits: int, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over integer codes; q fp32 [n, H, hd] (heads contiguous) -> fp32 [n, H, hd];
    block_table int64 [n or 1, >= blocks used] (one row: one prompt chunk's queries share it);
    ``window``, ``softcap`` and ``sinks`` as ``native_fp32.paged_decode``."""
    lib = load()
    assert lib is not None, "paged_decode_int needs the native kernels; check load() first"
    n, h, hd = q.shape
    _check_cache(k_cache, k_params, k_bits, hd)
    _check_cache(v_cache, v_params, v_bits, hd)
    nb, bs, kvh = k_cache.shape[:3]
    if (q.device.type != "cpu" or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != hd or h % kvh
            or block_table.shape[0] not in (1, n) or v_cache.shape[:3] != k_cache.shape[:3]):
        raise ValueError(f"paged_decode_int: unsupported layout q {tuple(q.shape)}/{q.stride()} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)}")
    bt, lens = as_i64(block_table), as_i64(seq_lens)
    table_stride = bt.stride(0) if bt.shape[0] == n else 0  # one table row: all queries share it
    out = torch.empty(n, h, hd, dtype=torch.float32)
    rc = lib.qp_paged_decode_int(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                 k_params.data_ptr(), v_params.data_ptr(), k_bits, v_bits, bt.data_ptr(),
                                 table_stride, bt.shape[1], lens.data_ptr(), out.data_ptr(), n, h, kvh, hd, bs, scale,
                                 nb, num_threads(), window or 0, softcap or 0.0, sink_pointer(sinks, q.shape[1]))
    check_decode(rc, "paged_decode_int", nb)
    return out
