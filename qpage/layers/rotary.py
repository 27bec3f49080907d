"""Rotary position embeddings (rotate-half layout) with the rope_scaling variants we support."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] in fp32 after the checkpoint's rope_scaling, and the
    factor cos and sin are scaled by (1 but for LongRoPE). ``max_positions``: the context the
    model runs with, which picks LongRoPE's factors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0  # type: ignore[arg-type]
    if rope_type in ("longrope", "su"):
        return _longrope(inv_freq, scaling, max_positions)  # type: ignore[arg-type]
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)  # type: ignore[arg-type]
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}. ('dynamic' NTK changes the rotation of cached keys "
        "with the batch's length, which a paged cache cannot honour; use a checkpoint without it "
        "or set max_model_len within original_max_position_embeddings and drop rope_scaling.)"
    )


def _longrope(inv_freq: torch.Tensor, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the long ones where the model
    runs past ``original_max_position_embeddings``, else the short ones, for every position (as
    llama.cpp decides by its context size: a cached key's rotation never changes), and cos/sin
    scaled by sqrt(1 + ln(factor) / ln(original)) (``attention_factor`` where given)."""
    original = int(s["original_max_position_embeddings"])
    factors = s["long_factor"] if max_positions > original else s["short_factor"]
    if len(factors) != inv_freq.numel():
        raise ValueError(f"rope_scaling: longrope has {len(factors)} factors, the head needs {inv_freq.numel()}")
    factor = float(s.get("factor") or s["max_position_embeddings"] / original)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(attention)


def _yarn(head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor`` (interpolated), those turning more than ``beta_fast`` times kept, a
    linear ramp over the dimensions between (their bounds floored and ceiled unless ``truncate``
    is false); cos/sin scaled by ``attention_factor``, else 0.1 ln(factor) + 1 (DeepSeek's
    ``mscale`` / ``mscale_all_dim`` ratio where both are given). The same for every position, so
    a cached key's rotation never changes (transformers' ``_compute_yarn_parameters``)."""
    original = float(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or s["max_position_embeddings"] / original)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001))
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(mid, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), looked up once per forward."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq, scale = rope_inv_freq(head_dim, theta, scaling, max_positions)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sin = emb.sin() * scale
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half negated.
        sin[:, :half] = -sin[:, :half]
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of shape [T, 1, head_dim] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] -> x*cos + rotate_half(x)*sin, in three ops."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
