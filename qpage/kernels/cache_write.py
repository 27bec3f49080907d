"""Write this step's K and V into the paged cache, quantizing to FP8 when the cache is FP8.

Cache layout per layer (``layers/attention.py``): ``k_cache``, ``v_cache`` of shape
[num_blocks, BLOCK_SIZE, kv_heads, head_dim], flattened to slots: token slot ``s`` is
block ``s // BLOCK_SIZE``, offset ``s % BLOCK_SIZE``; ``slot_mapping[t] = -1`` skips
token t (padding). dtype: the model's (``auto``) or uint8 FP8 codes.

FP8 scales, two modes:
- per token (qpage's default): ``k_scale``/``v_scale`` fp16 [num_blocks, BLOCK_SIZE,
  kv_heads]; a head's scale is its amax / FP8_MAX rounded to fp16, and the codes are
  ``encode(x / scale)``: decode is ``code * scale``.
- per tensor (vLLM-compatible): ``k_scale``/``v_scale`` fp32 [1], static, e.g. a
  checkpoint's ``k_scale``.
"""

import torch

from qpage.kernels.fp8_codec import encode_fp8_ref, f32_to_fp8, fp8_max
from qpage.kernels.triton_utils import tl, triton

MIN_SCALE = 2.0**-24
"""Floor of a per-token scale (fp16's smallest subnormal): an all-zero head stays exact."""


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    FP8: tl.constexpr, IS_E5M2: tl.constexpr, PER_TOKEN: tl.constexpr, FMAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, DIM_PAD)
        mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
        if FP8:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if PER_TOKEN:
                h_mask = offs_h < KV_HEADS
                ks = tl.maximum(tl.math.div_rn(tl.max(tl.abs(k), axis=1), FMAX), 2.0**-24).to(tl.float16)
                vs = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), FMAX), 2.0**-24).to(tl.float16)
                tl.store(ks_ptr + slot * KV_HEADS + offs_h, ks, mask=h_mask)
                tl.store(vs_ptr + slot * KV_HEADS + offs_h, vs, mask=h_mask)
                k_div = ks.to(tl.float32)[:, None] + tl.zeros((HEADS_PAD, DIM_PAD), dtype=tl.float32)
                v_div = vs.to(tl.float32)[:, None] + tl.zeros((HEADS_PAD, DIM_PAD), dtype=tl.float32)
            else:
                k_div = tl.load(ks_ptr).to(tl.float32) + tl.zeros((HEADS_PAD, DIM_PAD), dtype=tl.float32)
                v_div = tl.load(vs_ptr).to(tl.float32) + tl.zeros((HEADS_PAD, DIM_PAD), dtype=tl.float32)
            tl.store(kc_ptr + dst, f32_to_fp8(tl.math.div_rn(k, k_div), IS_E5M2), mask=mask)
            tl.store(vc_ptr + dst, f32_to_fp8(tl.math.div_rn(v, v_div), IS_E5M2), mask=mask)
        else:
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
) -> None:
    """k, v: [T, kv_heads, head_dim]; caches contiguous; scales as in the module docstring."""
    t, kvh, hd = k.shape
    if t == 0:
        return
    fp8 = fp8_format is not None
    per_token = fp8 and k_scale is not None and k_scale.dim() == 3
    ks = k_scale if fp8 else k_cache
    vs = v_scale if fp8 else v_cache
    _cache_write_kernel[(t,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kvh, HEAD_DIM=hd, HEADS_PAD=triton.next_power_of_2(kvh), DIM_PAD=triton.next_power_of_2(hd),
        FP8=fp8, IS_E5M2=fp8_format == "e5m2", PER_TOKEN=per_token,
        FMAX=fp8_max(fp8_format) if fp8 else 1.0,
        num_warps=4,
    )


def per_token_scales_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp16 scale per (token, head) of x [T, heads, dim]: amax / FP8_MAX, floored."""
    return (x.float().abs().amax(-1) / fp8_max(fmt)).clamp_min(MIN_SCALE).to(torch.float16)


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of x [T, heads, dim] under fp16 per-token scales [T, heads] or an fp32 [1] scale."""
    s = scale.float()[..., None] if scale.dim() == 2 else scale.float()
    return encode_fp8_ref(x.float() / s, fmt)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    kvh, hd = k.shape[1], k.shape[2]
    if fp8_format is None:
        k_cache.view(-1, kvh, hd).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, hd).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    assert k_scale is not None and v_scale is not None
    if k_scale.dim() == 3:
        ks, vs = per_token_scales_ref(k, fp8_format), per_token_scales_ref(v, fp8_format)
        k_scale.view(-1, kvh).index_copy_(0, slots, ks)
        v_scale.view(-1, kvh).index_copy_(0, slots, vs)
    else:
        ks, vs = k_scale, v_scale
    k_cache.view(-1, kvh, hd).index_copy_(0, slots, quantize_kv_ref(k, ks, fp8_format))
    v_cache.view(-1, kvh, hd).index_copy_(0, slots, quantize_kv_ref(v, vs, fp8_format))
