"""Packed-weight matmuls on CPU through torch's own kernels: INT4 and INT8 weights kept
packed in memory (4 or 8 bits per weight instead of the 32 of a dequantized fp32 copy).

- INT4: ``_weight_int4pack_mm_for_cpu`` computes ``w = (q - 8) * scale + zero`` per group of
  rows (group 32/64/128/256, N a multiple of 16, K a multiple of the group). The GPTQ form
  ``w = (q - z) * s`` maps onto it exactly with ``zero = (8 - z) * s``. A K that is not a
  multiple of the group (the default model's 576 with group 128) is padded with zero rows,
  and the activations with zero columns. Act-order (``g_idx``) checkpoints are reordered
  once so that each group's rows are contiguous; forward then permutes the activations'
  columns the same way (``x[:, perm] @ W[perm]`` = ``x @ W``).
- INT8 per channel: ``_weight_int8pack_mm`` computes ``x @ (q * s)^T`` for signed codes.
  GPTQ's unsigned codes with zero z become ``q - 128``; an asymmetric zero adds
  ``sum(x) * (128 - z) * s``.

Both are fast only with bf16 activations; with fp32 or fp16 activations torch runs a slow
path (far slower than fp32 BLAS, docs/cpu.md), so those models dequantize instead.
Which path is fastest where is measured by ``benchmarks/cpu_paths.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_GROUPS = (32, 64, 128, 256)
FAST_DTYPES = (torch.bfloat16,)


def packed_reason(bits: int, group_size: int, g_idx: torch.Tensor | None, in_features: int,
                  out_features: int, dtype: torch.dtype) -> str | None:
    """Why the packed CPU kernel cannot run this layer (None: it can)."""
    if dtype not in FAST_DTYPES:
        return f"activations are {dtype} (torch's packed CPU kernels are fast only with bf16)"
    if bits == 8:
        return None if group_size >= in_features else "int8 with groups (torch's int8 kernel is per channel)"
    if bits != 4:
        return f"{bits}-bit weights"
    if group_size not in INT4_GROUPS:
        return f"group size {group_size} (torch's int4 kernel takes {INT4_GROUPS})"
    if out_features % 16:
        return f"{out_features} output features (torch's int4 kernel needs a multiple of 16)"
    if g_idx is not None and _act_order_perm(g_idx, group_size) is None:
        return "g_idx is not a permutation into equal groups"
    return None


def _act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The row order that makes each group contiguous, None if g_idx has uneven groups;
    an identity order is returned as an empty tensor (no permutation needed)."""
    k = g_idx.numel()
    plain = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), plain):
        return torch.empty(0, dtype=torch.long)
    perm = torch.argsort(g_idx.long(), stable=True)
    return perm if torch.equal(g_idx.long()[perm], plain) else None


@dataclass
class Int4Packed:
    weight: torch.Tensor
    """uint8 [N, K_pad / 2] (torch's CPU int4 layout)."""
    scales_zeros: torch.Tensor
    """[K_pad / group, N, 2] in the activation dtype."""
    group_size: int
    pad: int
    """Zero columns appended to the activations (K_pad - K)."""
    perm: torch.Tensor | None
    """Activation column order (act-order), or None."""

    def nbytes(self) -> int:
        extra = self.perm.numel() * 8 if self.perm is not None else 0
        return self.weight.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size() + extra


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, dtype: torch.dtype) -> Int4Packed:
    """q int [K, N] in 0..15, scales [G, N], zeros int [G, N] (GPTQ convention) -> packed."""
    k = q.shape[0]
    perm = _act_order_perm(g_idx, group_size) if g_idx is not None else None
    if perm is not None and perm.numel() == 0:
        perm = None
    if perm is not None:
        q = q[perm]
    pad = (-k) % group_size
    q = F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)  # padded rows meet zero activations
    s = scales.float()
    if s.shape[0] != (k + pad) // group_size:
        raise ValueError(f"{s.shape[0]} scale groups for {k} rows in groups of {group_size}")
    zero = (8 - zeros.float()) * s
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().contiguous(), 1)
    sz = torch.stack([s, zero], dim=-1).to(dtype).contiguous()
    return Int4Packed(weight, sz, group_size, pad, perm)


def int4_mm(x: torch.Tensor, p: Int4Packed) -> torch.Tensor:
    """``x @ W`` for x [M, K] (bf16/fp16)."""
    if p.perm is not None:
        x = x.index_select(-1, p.perm)
    if p.pad:
        x = F.pad(x, (0, p.pad))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), p.weight, p.group_size, p.scales_zeros)


@dataclass
class Int8Packed:
    weight: torch.Tensor
    """int8 [N, K]."""
    scales: torch.Tensor
    """[N] in the activation dtype."""
    offset: torch.Tensor | None
    """(128 - z) * s [N] for asymmetric zeros, None when every zero is 128."""

    def nbytes(self) -> int:
        extra = self.offset.numel() * self.offset.element_size() if self.offset is not None else 0
        return self.weight.numel() + self.scales.numel() * self.scales.element_size() + extra


def pack_int8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> Int8Packed:
    """q int [K, N] in 0..255, scales [1, N], zeros int [1, N] (one group spanning K) -> packed."""
    weight = (q.to(torch.int32) - 128).to(torch.int8).t().contiguous()
    s = scales.float().reshape(-1)
    z = zeros.reshape(-1)
    offset = None if bool((z == 128).all()) else ((128 - z.float()) * s).to(dtype)
    return Int8Packed(weight, s.to(dtype), offset)


def int8_mm(x: torch.Tensor, p: Int8Packed) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), p.weight, p.scales)
    if p.offset is not None:
        y = y + x.float().sum(-1, keepdim=True).to(x.dtype) * p.offset
    return y
