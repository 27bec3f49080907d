"""Fused mixture-of-experts for INT4/INT8 experts in the GPTQ layout (vLLM's ``fused_moe``
shape): one launch per projection for all experts of a layer. Untimed.

The (token, k) pairs a router chose (slot s = token * top_k + k) are sorted by expert, and
each expert's run is padded to a multiple of ``BLOCK_M`` with an out-of-range slot
(``align_by_expert``), so every M tile holds rows of one expert: program (m tile, n tile)
reads that expert's packed words, scales and zeros (the experts stacked on a leading axis)
and its rows of the activations, and writes the slots' output rows. gate/up reads row
``s // top_k`` of the hidden states; down reads row ``s`` of the activations and multiplies
by the slot's routing weight, so the layer's output is the sum of each token's top_k rows.

Layouts per expert: ``qpage.kernels.int_matmul.common`` (GPTQ: qweight [K / P, N], scales
[G, N], qzeros [G, N / P]); here with a leading expert axis. A K tile lies inside one group
(``group_size % BLOCK_K == 0``), no act-order.
"""

from __future__ import annotations

import torch

from qpage.kernels.int_matmul.common import col_zero_scale, gather_q
from qpage.kernels.packing import dequantize_ref
from qpage.kernels.triton_utils import INTERPRET, tl, triton

PackedExperts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(qweight int32 [E, K / P, N], scales [E, G, N], qzeros int32 [E, G, N / P] or None)."""


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int32 [P]: the slots sorted by expert, each expert's run padded to ``block_m`` with
    the slot count (out of range); tile_experts int32 [P / block_m]: the expert of each tile)."""
    flat = topk_ids.reshape(-1).long()
    pad = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    slots, experts = [], []
    start = 0
    for e in range(num_experts):
        n = int(counts[e])
        if n == 0:
            continue
        tiles = -(-n // block_m)
        run = torch.full((tiles * block_m,), pad, dtype=torch.int32, device=topk_ids.device)
        run[:n] = order[start : start + n].to(torch.int32)
        slots.append(run)
        experts.append(torch.full((tiles,), e, dtype=torch.int32, device=topk_ids.device))
        start += n
    return torch.cat(slots), torch.cat(experts)


@triton.jit
def _fused_moe_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, w_ptr, slots_ptr, experts_ptr,
    num_slots, N, K, group_size,
    stride_xm, stride_xk, stride_qe, stride_qk, stride_qn, stride_se, stride_sg, stride_sn,
    stride_ze, stride_zg, stride_zn, stride_ym, stride_yn,
    TOP_K: tl.constexpr, X_PER_SLOT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < num_slots
    rows = slots if X_PER_SLOT else slots // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    qw = qw_ptr + expert * stride_qe
    sp = s_ptr + expert * stride_se
    zp = z_ptr + expert * stride_ze
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = gather_q(qw, offs_k, offs_n, k_mask, n_mask, stride_qk, stride_qn, False, BITS)
        z, s = col_zero_scale(sp, zp, (t * BLOCK_K) // group_size, offs_n, n_mask, stride_sg, stride_sn,
                              stride_zg, stride_zn, False, BITS, HAS_ZEROS)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), (q - z[None, :]).to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, (q - z[None, :]).to(x.dtype))
        acc += part * s[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + slots, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + slots[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def grouped_matmul(x: torch.Tensor, experts: PackedExperts, slots: torch.Tensor, tile_experts: torch.Tensor,
                   top_k: int, num_slots: int, *, bits: int, group_size: int, x_per_slot: bool,
                   weights: torch.Tensor | None = None, block_m: int = 16, block_n: int = 32,
                   block_k: int = 32) -> torch.Tensor:
    """[num_slots, N]: slot s's row of x (row s // top_k, or s with ``x_per_slot``) times its
    expert's weight, times ``weights[s]`` where given."""
    qweight, scales, qzeros = experts
    if group_size % block_k:
        raise ValueError(f"block_k {block_k} must divide the group size {group_size}")
    n, k = scales.shape[2], x.shape[1]
    y = torch.zeros(num_slots, n, dtype=x.dtype, device=x.device)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    w = weights.reshape(-1) if weights is not None else scales
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        x, qweight, scales, zeros, y, w, slots, tile_experts,
        num_slots, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), qweight.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2), zeros.stride(0), zeros.stride(1), zeros.stride(2),
        y.stride(0), y.stride(1),
        TOP_K=top_k, X_PER_SLOT=x_per_slot, MUL_WEIGHT=weights is not None, BITS=bits,
        HAS_ZEROS=qzeros is not None, DOT_F32=INTERPRET or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: PackedExperts,
              down: PackedExperts, *, bits: int, group_size: int, block_m: int = 16) -> torch.Tensor:
    """x [M, H] through the routed experts (SiLU(gate) * up, then down), weighted and summed
    over each token's top_k: [M, H]. ``gate_up``'s N is 2 * inter, gate rows first."""
    m, top_k = topk_ids.shape
    num_experts = gate_up[0].shape[0]
    slots, tile_experts = align_by_expert(topk_ids, num_experts, block_m)
    h = grouped_matmul(x, gate_up, slots, tile_experts, top_k, m * top_k, bits=bits, group_size=group_size,
                       x_per_slot=False, block_m=block_m)
    inter = h.shape[1] // 2
    act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    out = grouped_matmul(act, down, slots, tile_experts, top_k, m * top_k, bits=bits, group_size=group_size,
                         x_per_slot=True, weights=topk_weights.to(torch.float32), block_m=block_m)
    return out.view(m, top_k, -1).float().sum(1).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: PackedExperts,
                  down: PackedExperts, *, bits: int, group_size: int) -> torch.Tensor:
    """The same in plain torch: each expert's weights dequantized, its rows in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up[0].shape[0]):
        token, k = torch.nonzero(topk_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        w1 = dequantize_ref(gate_up[0][e], gate_up[1][e], None if gate_up[2] is None else gate_up[2][e], None,
                            bits=bits, group_size=group_size, in_features=x.shape[1])
        h = x[token].float() @ w1
        inter = h.shape[1] // 2
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        w2 = dequantize_ref(down[0][e], down[1][e], None if down[2] is None else down[2][e], None,
                            bits=bits, group_size=group_size, in_features=inter)
        out.index_add_(0, token, (act @ w2) * topk_weights[token, k].float()[:, None])
    return out.to(x.dtype)
