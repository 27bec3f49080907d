"""FP8 (E4M3) weight quantization: scale = amax / 448 per output channel or per 128x128 block.

E4M3's largest finite value is 448; each channel's (or block's) largest magnitude maps to
it and every weight rounds to the nearest E4M3 value of w / scale (torch's conversion,
round-to-nearest-even, which the Triton kernels decode bit-exactly). No calibration.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 128


def quantize_fp8(w: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes float8_e4m3fn [out, in], scale fp32: [out, 1] per channel or
    [ceil(out/block), ceil(in/block)] per block). ``w ~= codes * scale`` (scale broadcast)."""
    w = w.float()
    out_f, in_f = w.shape
    if block is None:
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    rb, cb = -(-out_f // block), -(-in_f // block)
    padded = torch.nn.functional.pad(w, (0, cb * block - in_f, 0, rb * block - out_f))
    amax = padded.abs().view(rb, block, cb, block).amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp_min(1e-12)
    full = expand_block_scale(scale, out_f, in_f, block)
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def expand_block_scale(scale: torch.Tensor, out_f: int, in_f: int, block: int = BLOCK) -> torch.Tensor:
    """[ceil(out/b), ceil(in/b)] block scales -> [out, in], one per weight."""
    return scale.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The [out, in] fp32 weight that (codes, scale) encode."""
    w = codes.float()
    if block is None:
        return w * scale.reshape(-1, 1).float()
    return w * expand_block_scale(scale.float(), w.shape[0], w.shape[1], block)
