"""How a K/V row becomes int8 or int4 codes with its per-(token, kv head) parameters, in plain torch.

The references every integer-cache kernel is checked against (the C kernels in
``cpu.native_int``, the Triton kernels in ``attention.int_cache``), so a cache written by one
reads the same through any other.

Layout per layer, beside the paged codes [num_blocks, BLOCK, kv_heads, ...]:
- ``int8``: int8 codes [..., head_dim], symmetric: value = code * scale; ``scale`` fp16
  [num_blocks, BLOCK, kv_heads, 1] = amax / 127, codes in [-127, 127].
- ``int4``: uint8 [..., head_dim // 2], two codes a byte: the low nibble holds channel d,
  the high nibble channel d + head_dim/2 (so unpacking is two contiguous halves, no
  interleave); asymmetric: value = code * scale + zero with fp16 [..., 2] = (scale, zero),
  zero = the row's minimum rounded to fp16 and scale = (max - min) / 15; codes in [0, 15].
Scales are rounded up to fp16 (``half_at_least``); codes are rounded to nearest even after
an fp32 divide, which C (``nearbyintf``) and Triton (``rint``) reproduce bit for bit. K and
V must lie within fp16's range (+-65504), as for an fp16 cache.
"""

from __future__ import annotations

import functools
import math

import torch

MIN_SCALE = 2.0**-24
"""Floor of a scale (fp16's smallest subnormal): an all-equal row stays exact."""
PARAMS = {8: 1, 4: 2}
"""fp16 parameters per (token, kv head): int8 a scale; int4 a scale and a zero."""


def code_width(bits: int, head_dim: int) -> int:
    """Bytes of codes per (token, kv head)."""
    return head_dim if bits == 8 else head_dim // 2


def head_dim_of(bits: int, width: int) -> int:
    """The head_dim whose codes take ``width`` bytes (``code_width`` inverted)."""
    return width if bits == 8 else 2 * width


def quantize_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and fp16 parameters of x [..., head_dim] (see the module docstring)."""
    xf = x.float()
    if bits == 8:
        s = half_at_least((xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(MIN_SCALE))
        codes = torch.round(xf / s.float()).clamp(-127, 127).to(torch.int8)
        return codes, s
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    s = half_at_least(((hi - lo) / 15.0).clamp_min(MIN_SCALE))
    z = lo.to(torch.float16)
    q = torch.round((xf - z.float()) / s.float()).clamp(0, 15).to(torch.uint8)
    half = x.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4), torch.cat([s, z], -1)


def half_at_least(s: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= each positive fp32 of ``s``: a scale rounded up never clips the
    row's largest value (rounding to nearest could, by up to half an fp16 step, which is
    large relative to the value among fp16's subnormals)."""
    h = s.to(torch.float16)
    return torch.where(h.float() < s, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., hd/2] -> codes uint8 [..., hd] (low nibbles first, then high)."""
    return torch.cat([packed & 15, packed >> 4], -1)


def dequantize_ref(codes: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 values of codes with their parameters (the layout of ``quantize_ref``)."""
    p = params.float()
    if bits == 8:
        return codes.float() * p
    return unpack_int4(codes).float() * p[..., :1] + p[..., 1:]


def write_int_cache_ref(x: torch.Tensor, cache: torch.Tensor, params: torch.Tensor, slot_mapping: torch.Tensor,
                        bits: int) -> None:
    """Quantize K or V rows x [T, kvh, hd] into the slots ``slot_mapping`` (-1 skips a token)."""
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, x = slots[keep], x[keep]
    kvh = x.shape[1]
    codes, p = quantize_ref(x, bits)
    cache.view(-1, kvh, cache.shape[-1]).index_copy_(0, slots, codes)
    params.view(-1, kvh, params.shape[-1]).index_copy_(0, slots, p)


@functools.cache
def hadamard(head_dim: int) -> tuple[torch.Tensor, int]:
    """An orthonormal, symmetric fp32 [head_dim, head_dim] rotation (its own inverse) and its
    block size: Sylvester's Hadamard matrix when head_dim is a power of two, else a
    block-diagonal one over the largest power-of-two block dividing head_dim (head_dim 96:
    three blocks of 32), which spreads outliers within each block only."""
    block = head_dim & -head_dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h / math.sqrt(block)] * (head_dim // block))
    return h.float(), block


def walsh_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] times ``hadamard(D)[0]`` (block-diagonal, ``block`` a power of two dividing D),
    as log2(block) butterfly steps (a + b, a - b) and one scaling: every output element comes
    from the same additions in the same order whatever the shape of x around it."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block, block)
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(y.shape)
        h *= 2
    return (y * (1.0 / math.sqrt(block))).view(shape)
