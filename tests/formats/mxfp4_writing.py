"""Writing a gpt-oss checkpoint with its experts in MXFP4 blocks, as OpenAI publishes gpt-oss
(``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``), for the MXFP4 test and benchmark."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, in] -> (codes uint8 [..., rows, in / 32, 16], exponents uint8 [..., rows, in / 32]):
    per block the smallest power of two that puts the largest weight within E2M1's 6, each
    weight rounded to the nearest code (the OCP MX layout gpt-oss's checkpoints use)."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1).clamp_min(2.0**-120)
    e = torch.ceil(torch.log2(amax / 6.0))
    codes = ((g / torch.exp2(e)[..., None])[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).to(torch.uint8)


def write_mxfp4(src: Path, dst: Path) -> None:
    """``src``'s gpt-oss checkpoint with its stacked experts in MXFP4 blocks."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    out = {}
    for name, t in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [experts, in, out]
            out[f"{name}_blocks"], out[f"{name}_scales"] = to_mxfp4(t.transpose(1, 2).contiguous())
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (dst / "config.json").write_text(json.dumps(cfg))
