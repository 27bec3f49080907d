"""GPTQ, AWQ and compressed-tensors integer weights as llama.cpp-style blocks, so the block
kernels (``native_gguf``) run them: one kernel family for every quantized format on CPU.

An integer weight is ``w = s * (q - z)`` per group of input rows (``formats.gptq`` layout,
zeros already in that convention). Each 32-row block of one group becomes one block of:

- Q4_0 (``d = s``, codes ``q``, offset -8 d) when every zero is 8: exact;
- Q4_1 (``d = s``, ``m = -s z``, codes ``q``) for other 4-bit zeros: ``m`` is rounded to
  fp16, an error of at most 2^-11 |m| <= 0.008 s, far below the rounding step ``s``;
- Q8_0 (``d = s``, codes ``q - 128``) when every zero is 128: exact;
- Q8_M (``d = s``, ``m = -s (z - 128)``, codes ``q - 128``) for other 8-bit zeros: ``m``
  rounded to fp16 is off by at most 2^-11 |m| <= 0.0625 s, a constant per block that stays
  well below the rounding step's own error (RMS 0.29 s).

Scales are rounded to fp16 (exact for GPTQ/AWQ, which store fp16). Act-order (``g_idx``)
weights are sorted once so that each group's rows are contiguous; the matmul then gathers
the activations' columns in the same order (``x[:, perm] @ W[perm] = x @ W``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qpage.kernels.cpu.matmul.native_gguf import Q4_0, Q4_1, Q8_0, Q8_M

BLOCK = 32
FP16_MAX = 65504.0


def block_order(g_idx: torch.Tensor | None, group_size: int, k: int) -> torch.Tensor | None:
    """The input-row order in which every 32-row block lies in one group: empty for the
    stored order, a permutation for act-order, None when no order does (uneven groups)."""
    grp = _groups(g_idx, group_size, k)
    if _blocks_uniform(grp):
        return torch.empty(0, dtype=torch.long)
    perm = torch.argsort(grp, stable=True)
    return perm if _blocks_uniform(grp[perm]) else None


def int_blocks_reason(bits: int, group_size: int, g_idx: torch.Tensor | None, k: int) -> str | None:
    """Why an integer weight has no block form (None: it has)."""
    if bits not in (4, 8):
        return f"{bits}-bit weights (the blocks hold 4 or 8 bits)"
    if k % BLOCK:
        return f"rows of {k} inputs are not whole 32-weight blocks"
    if g_idx is None and group_size % BLOCK and group_size < k:
        return f"group size {group_size} is not a multiple of 32"
    if block_order(g_idx, group_size, k) is None:
        return "g_idx does not sort into whole 32-row blocks per group"
    return None


@dataclass
class BlockRows:
    """A weight [n, k] as rows of one block format (uint8 [n, k / 32 * block bytes]), and the
    input order it was written in (None: the stored order)."""

    rows: np.ndarray
    ggml_type: int
    perm: torch.Tensor | None


def to_block_rows(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
                  bits: int, group_size: int) -> BlockRows:
    """Codes q [k, n] (0 .. 2^bits - 1), scales and zeros [groups, n] -> block rows."""
    k, n = q.shape
    symmetric = bool((zeros == 1 << (bits - 1)).all())
    why = int_blocks_reason(bits, group_size, g_idx, k)
    if why is not None:
        raise ValueError(f"int weight [{k} -> {n}] has no block form: {why}")
    s = scales.float()
    if not bool(torch.isfinite(s).all()) or float(s.abs().max()) > FP16_MAX:
        raise ValueError("int weight scales beyond fp16's range cannot be written as blocks")
    perm = block_order(g_idx, group_size, k)
    assert perm is not None  # int_blocks_reason checked it
    grp = _groups(g_idx, group_size, k)
    if perm.numel():
        q, grp = q[perm], grp[perm]
    block_grp = grp[::BLOCK]  # [k / 32]: each block's group
    d = s[block_grp].t().contiguous()  # [n, nb]
    codes = q.t().to(torch.uint8).numpy().reshape(n, k // BLOCK, BLOCK)
    d16 = d.numpy().astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    if symmetric:
        offset: list[np.ndarray] = []
    else:  # m = -s (z - centre): 8-bit codes are held centred (as int8), 4-bit ones as they are
        centre = 128 if bits == 8 else 0
        with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
            m16 = (-(d * (zeros.float()[block_grp].t() - centre))).numpy().astype(np.float16)
        if not np.isfinite(m16).all():
            raise ValueError("int weight offsets -s z beyond fp16's range cannot be written as blocks")
        offset = [m16.view(np.uint8).reshape(n, -1, 2)]
    if bits == 8:
        t, fields = (Q8_0 if symmetric else Q8_M), [d16, *offset, codes ^ 0x80]  # q - 128 as int8 bits
    else:
        t, fields = (Q4_0 if symmetric else Q4_1), [d16, *offset, codes[..., :16] | (codes[..., 16:] << 4)]
    rows = np.concatenate(fields, axis=2).reshape(n, -1)
    return BlockRows(rows, t, perm if perm.numel() else None)


def _groups(g_idx: torch.Tensor | None, group_size: int, k: int) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long().cpu()
    return torch.arange(k) // max(group_size, 1)


def _blocks_uniform(grp: torch.Tensor) -> bool:
    b = grp.reshape(-1, BLOCK)
    return bool((b == b[:, :1]).all())
