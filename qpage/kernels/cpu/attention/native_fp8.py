"""The FP8 KV cache kernels in C (``csrc/cpu_fp8.c``): the cache write with the per-token
scale search, bit-exact with ``kv_quant.write_kv_cache_ref``, and paged decode attention
over the codes, as ``TorchPagedAttention._decode`` computes it on the dequantized cache.

Why: with an FP8 cache the torch path quantizes each decode token through dozens of small ops
per layer (one set per candidate scale) and dequantizes the whole context before attending
(docs/cpu.md); these read and write the codes in place.
"""

from __future__ import annotations

import functools

import torch

from qpage.kernels.cpu.native import as_i64, check_decode, load, num_threads, sink_pointer
from qpage.kernels.fp8.codec import decode_fp8_ref
from qpage.kernels.kv_quant import scale_multipliers


@functools.cache
def code_values(fmt: str) -> torch.Tensor:
    """fp32 [256]: the value of each FP8 code (torch's conversion)."""
    return decode_fp8_ref(torch.arange(256, dtype=torch.int32).to(torch.uint8), fmt).contiguous()


@functools.cache
def _multipliers(fmt: str) -> torch.Tensor:
    return scale_multipliers(fmt).contiguous()


def _scales(k_scale: torch.Tensor, v_scale: torch.Tensor, nb: int, bs: int, kvh: int
            ) -> tuple[int, int, float, float]:
    """(k ptr, v ptr, k_mul, v_mul): fp16 per-token scales by pointer, or per-tensor values."""
    if k_scale.dim() == 3:
        ok = all(s.dtype == torch.float16 and s.is_contiguous() and tuple(s.shape) == (nb, bs, kvh)
                 for s in (k_scale, v_scale))
        if not ok:
            raise ValueError(f"FP8 cache: per-token scales must be fp16 [{nb}, {bs}, {kvh}] contiguous")
        return k_scale.data_ptr(), v_scale.data_ptr(), 1.0, 1.0
    if k_scale.numel() != 1 or v_scale.numel() != 1:
        raise ValueError("FP8 cache: a per-tensor scale must hold one value")
    return 0, 0, float(k_scale), float(v_scale)


def _check_codes(k_cache: torch.Tensor, v_cache: torch.Tensor, fmt: str) -> None:
    if (k_cache.dtype != torch.uint8 or k_cache.shape != v_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or fmt not in ("e4m3", "e5m2")):
        raise ValueError(f"FP8 cache: expected contiguous uint8 codes and format e4m3/e5m2, got "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} {fmt!r}")


def write_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, fmt: str) -> None:
    """``write_kv_cache_ref`` for an FP8 cache: k, v fp32 [T, kvh, hd] (heads contiguous)."""
    lib = load()
    assert lib is not None, "write_kv_fp8 needs the native kernels; check load() first"
    _check_codes(k_cache, v_cache, fmt)
    t, kvh, hd = k.shape
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    ok = all(x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == hd for x in (k, v))
    if not ok or k.shape != v.shape or tuple(k_cache.shape[2:]) != (kvh, hd):
        raise ValueError(f"write_kv_fp8: unsupported k/v {tuple(k.shape)} {k.dtype} for cache {tuple(k_cache.shape)}")
    kp, vp, k_div, v_div = _scales(k_scale, v_scale, nb, bs, kvh)
    slots = as_i64(slot_mapping)
    mult, lut = _multipliers(fmt), code_values(fmt)
    rc = lib.qp_write_kv_fp8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), kp, vp, k_div, v_div, slots.data_ptr(), t, kvh, hd, nb * bs,
                             mult.data_ptr(), mult.numel(), lut.data_ptr(), int(fmt == "e5m2"))
    if rc != 0:
        raise ValueError(f"write_kv_fp8: a slot outside [-1, {nb * bs}) in slot_mapping")


def paged_decode_fp8(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    fmt: str, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over FP8 codes; q fp32 [n, H, hd] (heads contiguous), returns fp32 [n, H, hd];
    block_table int64 [n or 1, >= blocks used] (one row: one prompt chunk's queries share it);
    ``window``, ``softcap`` and ``sinks`` as ``native_fp32.paged_decode``."""
    lib = load()
    assert lib is not None, "paged_decode_fp8 needs the native kernels; check load() first"
    _check_codes(k_cache, v_cache, fmt)
    n, h, hd = q.shape
    nb, bs, kvh, hd_c = k_cache.shape
    if (q.device.type != "cpu" or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != hd or hd_c != hd
            or h % kvh or block_table.shape[0] not in (1, n) or hd > 256):
        raise ValueError(f"paged_decode_fp8: unsupported layout q {tuple(q.shape)}/{q.stride()} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)}")
    kp, vp, k_mul, v_mul = _scales(k_scale, v_scale, nb, bs, kvh)
    bt, lens = as_i64(block_table), as_i64(seq_lens)
    table_stride = bt.stride(0) if bt.shape[0] == n else 0  # one table row: all queries share it
    out = torch.empty(n, h, hd, dtype=torch.float32)
    rc = lib.qp_paged_decode_fp8(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kp, vp, k_mul,
                                 v_mul, code_values(fmt).data_ptr(), int(fmt == "e5m2"), bt.data_ptr(), table_stride,
                                 bt.shape[1], lens.data_ptr(), out.data_ptr(), n, h, kvh, hd, bs, scale, nb,
                                 num_threads(), window or 0, softcap or 0.0, sink_pointer(sinks, q.shape[1]))
    check_decode(rc, "paged_decode_fp8", nb)
    return out
