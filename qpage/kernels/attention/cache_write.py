"""Write this step's K and V into the paged cache, quantizing to FP8 when the cache is FP8.

Cache layout per layer (``layers/attention/backends.py``): ``k_cache``, ``v_cache`` of shape
[num_blocks, BLOCK_SIZE, kv_heads, head_dim], flattened to slots: token slot ``s`` is
block ``s // BLOCK_SIZE``, offset ``s % BLOCK_SIZE``; ``slot_mapping[t] = -1`` skips
token t (padding). dtype: the model's (``auto``) or uint8 FP8 codes.

FP8 scales, two modes:
- per token (qpage's default): ``k_scale``/``v_scale`` fp16 [num_blocks, BLOCK_SIZE,
  kv_heads]; the codes are ``encode(x / scale)`` and decode is ``code * scale``. The scale
  of a (token, head) is chosen among SCALE_CANDIDATES values, amax * c_j with
  c_j = 1 / (FP8_MAX * 2**(-j / N)) (so the largest element lands at FP8_MAX * 2**(-j/N)),
  rounded to fp16: the one whose codes reconstruct the head with the least squared error.
  A float format's relative step is fixed, but where the grid falls is not: on the default
  model's keys the search cuts the attention-distribution KL of the FP8 keys against plain
  amax / FP8_MAX (docs/kv-cache.md). The error sums are fp64, so the kernel and the
  torch reference pick the same candidate.
- per tensor (vLLM-compatible): ``k_scale``/``v_scale`` fp32 [1], static, e.g. a
  checkpoint's ``k_scale``.
"""

import torch

from qpage.kernels.fp8.codec import f32_to_fp8, fp8_to_f32
from qpage.kernels.kv_quant import SCALE_CANDIDATES, scale_multipliers
from qpage.kernels.triton_utils import tl, triton


@triton.jit
def _search_scale(x, mult_ptr, NUM_CAND: tl.constexpr, IS_E5M2: tl.constexpr):
    """Codes and fp16 scales [heads] of x [heads, dim] fp32 (see the module docstring)."""
    amax = tl.max(tl.abs(x), axis=1)
    best_err = tl.full(amax.shape, float("inf"), dtype=tl.float64)
    best_s = tl.zeros(amax.shape, dtype=tl.float16)
    best_codes = tl.zeros(x.shape, dtype=tl.uint8)
    for j in tl.static_range(NUM_CAND):
        s = tl.maximum(amax * tl.load(mult_ptr + j), 2.0**-24).to(tl.float16)
        sf = s.to(tl.float32)[:, None] + tl.zeros(x.shape, dtype=tl.float32)
        codes = f32_to_fp8(tl.math.div_rn(x, sf), IS_E5M2)
        d = (fp8_to_f32(codes, IS_E5M2) * sf).to(tl.float64) - x.to(tl.float64)
        err = tl.sum(d * d, axis=1)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_s = tl.where(better, s, best_s)
        best_codes = tl.where(better[:, None], codes, best_codes)
    return best_codes, best_s


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, mult_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    FP8: tl.constexpr, IS_E5M2: tl.constexpr, PER_TOKEN: tl.constexpr, NUM_CAND: tl.constexpr,
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
                k_codes, ks = _search_scale(k, mult_ptr, NUM_CAND, IS_E5M2)
                v_codes, vs = _search_scale(v, mult_ptr, NUM_CAND, IS_E5M2)
                tl.store(ks_ptr + slot * KV_HEADS + offs_h, ks, mask=h_mask)
                tl.store(vs_ptr + slot * KV_HEADS + offs_h, vs, mask=h_mask)
                tl.store(kc_ptr + dst, k_codes, mask=mask)
                tl.store(vc_ptr + dst, v_codes, mask=mask)
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
    mult = _multipliers(fp8_format, k.device) if per_token else ks
    _cache_write_kernel[(t,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, mult,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kvh, HEAD_DIM=hd, HEADS_PAD=triton.next_power_of_2(kvh), DIM_PAD=triton.next_power_of_2(hd),
        FP8=fp8, IS_E5M2=fp8_format == "e5m2", PER_TOKEN=per_token, NUM_CAND=SCALE_CANDIDATES,
        num_warps=4,
    )


_MULT_CACHE: dict[tuple[str | None, torch.device], torch.Tensor] = {}


def _multipliers(fmt: str | None, device: torch.device) -> torch.Tensor:
    key = (fmt, device)
    if key not in _MULT_CACHE:
        assert fmt is not None
        _MULT_CACHE[key] = scale_multipliers(fmt).to(device)
    return _MULT_CACHE[key]
