"""Packing of the GPTQ and AWQ integer layouts, and the plain-torch references; no Triton.

Layouts: ``int_matmul.common``. The format readers, the quantizers and the CPU paths use the
packers; ``dequantize_ref`` / ``int_matmul_ref`` are what the kernels are tested against.
"""

import sys

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ packs column ``AWQ_ORDER[i]`` of each group of 8 into nibble i."""



def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [R / P, C] packed along rows -> int32 [rows, C] (GPTQ qweight)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1])[:rows]


def unpack_cols(packed: torch.Tensor, bits: int, cols: int, awq: bool = False) -> torch.Tensor:
    """int32 [R, C / P] packed along columns -> int32 [R, cols] (GPTQ qzeros; AWQ both)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(2) >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C/P, nibble]
    if awq:
        inverse = [AWQ_ORDER.index(c) for c in range(8)]
        vals = vals[:, :, inverse]
    return vals.reshape(packed.shape[0], -1)[:, :cols]


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] values in 0..2**bits-1 -> int32 [ceil(R / P), C], packed along rows."""
    return _pack_last(q.t(), bits).t().contiguous()


def pack_cols(q: torch.Tensor, bits: int, awq: bool = False) -> torch.Tensor:
    """int [R, C] values -> int32 [R, ceil(C / P)], packed along columns (AWQ order if asked)."""
    return _pack_last(q, bits, AWQ_ORDER if awq else None)


def _pack_last(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Values [..., K] -> int32 [..., ceil(K / P)]: value ``order[i]`` (default i) of each run
    of P goes to bits i*bits... 4- and 8-bit values are packed as bytes (two nibbles, or the
    value itself) viewed as little-endian int32 words: byte operations only, no wide copy."""
    pack = 32 // bits
    k = v.shape[-1]
    if k % pack:
        v = torch.nn.functional.pad(v.to(torch.int32), (0, (-k) % pack))
    v = v.reshape(*v.shape[:-1], -1, pack)
    if order is not None:
        v = v[..., list(order)]
    if bits in (4, 8) and sys.byteorder == "little":
        b = v.to(torch.uint8)
        if bits == 4:
            b = b[..., 0::2] | (b[..., 1::2] << 4)
        return b.contiguous().view(torch.int32).squeeze(-1)  # [..., K/P, 4 bytes] -> [..., K/P]
    acc = v[..., 0].to(torch.int64)
    for i in range(1, pack):
        acc.bitwise_or_(v[..., i].to(torch.int64) << (i * bits))
    return _to_int32(acc)


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def dequantize_ref(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, g_idx: torch.Tensor | None,
    *, bits: int, group_size: int, in_features: int, awq: bool = False,
) -> torch.Tensor:
    """The fp32 weight [K, N] the packed tensors encode."""
    n = scales.shape[1]
    q = unpack_cols(qweight, bits, n, awq=True) if awq else unpack_rows(qweight, bits, in_features)
    grp = g_idx.long() if g_idx is not None else torch.arange(in_features, device=q.device) // group_size
    if qzeros is None:
        z = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    else:
        z = unpack_cols(qzeros, bits, n, awq=awq)
    return (q - z[grp]).float() * scales.float()[grp]


def int_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, *, bits: int, group_size: int, awq: bool = False,
) -> torch.Tensor:
    w = dequantize_ref(qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size,
                       in_features=x.shape[-1], awq=awq)
    return (x.float() @ w).to(x.dtype)
