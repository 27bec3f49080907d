"""Triton helpers shared by the paged decode and prefill kernels: block lookup, K/V tile
loads (FP8 codes decoded in registers), per-token scales, and the launch arguments.

Cache layout (``cache_write``): ``k_cache``/``v_cache`` [num_blocks, BLOCK_SIZE, kv_heads,
head_dim] in the model dtype or as uint8 FP8 codes; per-token scales fp16 [num_blocks,
BLOCK_SIZE, kv_heads], or one fp32 per-tensor scale. ``block_tables`` int32 [seqs, max_blocks]
maps a sequence's logical block to a physical one.
"""

import torch

from qpage.kernels.fp8.codec import fp8_decoder, fp8_to_f16, fp8_unit
from qpage.kernels.triton_utils import INTERPRET, tl, triton

LOG2E = 1.4426950408889634
"""Scores are kept in log2 units (exp2): the softmax scale is multiplied by log2(e) once."""


@triton.jit
def blocks(bt_ptr, offs_n, n_mask, PAGE: tl.constexpr):
    """Physical block (int64) of each position ``offs_n`` of one sequence: read once per tile
    and shared by the K, V and scale loads."""
    return tl.load(bt_ptr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)


@triton.jit
def to_dot(raw, FP8: tl.constexpr, IS_E5M2: tl.constexpr, FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A loaded tile in the dot dtype. FP8 codes become value / (scale * unit): the caller
    applies the scale per token to the scores (K), and to the probabilities or, with V staged
    as fp16, to V's rows."""
    if FP8:
        return fp8_to_f16(raw, IS_E5M2, FP8_CVT).to(DOT_DTYPE)
    else:
        return raw.to(DOT_DTYPE)


@triton.jit
def load_raw(c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch, PAGE: tl.constexpr):
    """K or V rows of positions ``offs_n`` (in blocks ``blk``) as stored, [BLOCK_N, DIM_PAD]."""
    offs = (blk * stride_cb + (offs_n % PAGE) * stride_ct + head * stride_ch)[:, None] + offs_d[None, :]
    return tl.load(c_ptr + offs, mask=n_mask[:, None] & d_mask[None, :], other=0)


@triton.jit
def load_kv_tile(
    c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch,
    PAGE: tl.constexpr, FP8: tl.constexpr, IS_E5M2: tl.constexpr, FP8_CVT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """K or V rows of positions ``offs_n`` (in blocks ``blk``), [BLOCK_N, DIM_PAD] in DOT_DTYPE."""
    raw = load_raw(c_ptr, blk, offs_n, n_mask, offs_d, d_mask, head, stride_cb, stride_ct, stride_ch, PAGE)
    return to_dot(raw, FP8, IS_E5M2, FP8_CVT, DOT_DTYPE)


@triton.jit
def token_scale(s_ptr, blk, offs_n, n_mask, head, unit,
                 KV_HEADS: tl.constexpr, PAGE: tl.constexpr, PER_TOKEN: tl.constexpr):
    """[BLOCK_N] fp32 multiplier of each position's decoded row (1 where there is none).

    The offset is 32-bit (``check_scale_offsets``): a scale tensor holds 2 bytes per cached
    K or V row, so it stays under 2**31 elements long after the cache outgrows 32-bit byte
    offsets, and 64-bit address arithmetic costs instructions in every tile."""
    if PER_TOKEN:
        s = tl.load(s_ptr + (blk.to(tl.int32) * PAGE + offs_n % PAGE) * KV_HEADS + head, mask=n_mask, other=0.0)
        return s.to(tl.float32) * unit
    else:
        return tl.full(offs_n.shape, 1.0, dtype=tl.float32)


def launch_args(q: torch.Tensor, k_scale: torch.Tensor | None, fp8_format: str | None, scale: float,
                 scaled_rows: bool = False) -> tuple[list, dict]:
    """(qk_scale, unit) and the FP8 constexprs shared by the decode and prefill launches.

    The dot dtype is the activations' (fp32 under the interpreter), except that FP8 codes
    under bf16 activations are multiplied in fp16: the decoded codes (value / unit, at most
    448) are exact in fp16, which keeps 3 more mantissa bits than bf16 and saves converting
    every code fp16 -> fp32 -> bf16. Not where per-token scales multiply the K/V rows in the
    dot dtype (``scaled_rows``): a bf16 model's cache values need not fit fp16's range."""
    fp8 = fp8_format is not None
    per_token = fp8 and k_scale is not None and k_scale.dim() == 3
    if per_token:
        check_scale_offsets(k_scale)
    cvt = fp8_decoder(q.device, fp8_format) if fp8 else 0
    unit = fp8_unit(fp8_format, cvt) if fp8 else 1.0
    if INTERPRET or q.dtype == torch.float32:
        dot_dtype = tl.float32
    elif q.dtype == torch.bfloat16 and (not fp8 or (per_token and scaled_rows)):
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = tl.float16
    return [scale * LOG2E, unit], dict(FP8=fp8, IS_E5M2=fp8_format == "e5m2", PER_TOKEN=per_token, FP8_CVT=cvt,
                                       DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")


def check_scale_offsets(k_scale: torch.Tensor | None) -> None:
    """Per-token scale tensors are indexed with 32-bit offsets in the kernels (``token_scale``)."""
    if k_scale is not None and k_scale.numel() >= 2**31:
        raise ValueError(f"per-token KV scales hold {k_scale.numel()} elements, over the kernels' 32-bit offsets "
                         f"(2**31): use fewer KV cache blocks per layer (--kv-cache-memory / "
                         f"gpu_memory_utilization) or a per-tensor FP8 scale")
