"""How a K/V row becomes FP8 codes and a scale: the rules the cache writers share, in plain torch.

The Triton writer (``attention.cache_write``), the C writer (``cpu.native_fp8``) and the
torch path (``layers.attention.kv_format``) all pick the same per-token scale, so a cache written by one
reads the same through any other. Layout and scale modes: ``attention.cache_write``.
"""

import torch

from qpage.kernels.fp8.codec import decode_fp8_ref, encode_fp8_ref, fp8_max

MIN_SCALE = 2.0**-24
"""Floor of a per-token scale (fp16's smallest subnormal): an all-zero head stays exact."""
SCALE_CANDIDATES = 8


def scale_multipliers(fmt: str, n: int = SCALE_CANDIDATES) -> torch.Tensor:
    """fp32 [n]: c_j = 1 / (FP8_MAX * 2**(-j / n)); candidate scale j is amax * c_j."""
    return torch.tensor([1.0 / (fp8_max(fmt) * 2.0 ** (-j / n)) for j in range(n)], dtype=torch.float32)


def per_token_scales_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp16 scale per (token, head) of x [T, heads, dim]: the candidate with the least error."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    best_s, best_err = None, None
    for c in scale_multipliers(fmt).tolist():
        s = (amax * torch.tensor(c, dtype=torch.float32)).clamp_min(MIN_SCALE).to(torch.float16)
        dq = decode_fp8_ref(quantize_kv_ref(xf, s, fmt), fmt) * s.float()[..., None]
        err = ((dq.double() - xf.double()) ** 2).sum(-1)
        if best_s is None or best_err is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    assert best_s is not None
    return best_s


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of x [T, heads, dim] under fp16 per-token scales [T, heads] or an fp32 [1] scale."""
    s = scale.float()[..., None] if scale.dim() == 2 else scale.float()
    return encode_fp8_ref(x.float() / s, fmt)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, fp8_format: str | None = None,
) -> None:
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:  # drop pad slots (the engine's batches have none:
        keep = slots >= 0                        # a boolean mask costs time in every layer and step)
        slots, k, v = slots[keep], k[keep], v[keep]
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
