"""FP8 (E4M3) weight checkpoints: compressed-tensors FP8 (llm-compressor; vLLM loads it) and
Hugging Face's ``fp8`` (``weight_scale_inv`` with 128x128 blocks).

Per quantized linear ``<prefix>``: ``<prefix>.weight`` float8_e4m3fn [out, in] and
- compressed-tensors: ``<prefix>.weight_scale`` fp32 ``[out, 1]`` (strategy ``channel``),
  one value (``tensor``) or ``[ceil(out/128), ceil(in/128)]`` (``block``);
- HF fp8: ``<prefix>.weight_scale_inv`` fp32 ``[ceil(out/128), ceil(in/128)]`` (despite the
  name it multiplies: W = codes * scale_inv).
qpage writes compressed-tensors with ``format: "naive-quantized"`` (weight-only, as
llm-compressor writes it) and reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qpage.formats.safetensors_io import LazyTensor

SCALE_NAMES = ("weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class Fp8Config:
    block: int | None
    """Scale block edge (128) or None: per channel (a per-tensor scale is read as one)."""
    source: str
    """'compressed-tensors' or 'fp8' (Hugging Face)."""

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.source == "fp8" else "weight_scale"

    @classmethod
    def from_json(cls, qc: dict[str, Any], where: str) -> Fp8Config:
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            if block is not None and list(block) != [128, 128]:
                raise ValueError(f"{where}: fp8 weight_block_size={block!r} is not supported (use [128, 128])")
            if qc.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"{where}: fp8 fmt={qc.get('fmt')!r} is not supported (e4m3)")
            return cls(128 if block is not None else None, "fp8")
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"{where}: compressed-tensors with {len(groups)} config_groups is not supported; "
                             "qpage reads one group of FP8 weights")
        (group,) = groups.values()
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"{where}: compressed-tensors weights {w.get('type')}{w.get('num_bits')} are not "
                             "supported yet; qpage reads FP8 (type float, num_bits 8) compressed-tensors")
        strategy = w.get("strategy")
        if strategy in ("channel", "tensor"):
            return cls(None, "compressed-tensors")
        if strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return cls(128, "compressed-tensors")
        raise ValueError(f"{where}: compressed-tensors FP8 strategy={strategy!r} "
                         f"(block_structure={w.get('block_structure')!r}) is not supported; use channel, "
                         "tensor or block [128, 128]")


def quantization_config(block: int | None) -> dict[str, Any]:
    """compressed-tensors ``quantization_config`` for weight-only FP8 (what llm-compressor writes)."""
    weights: dict[str, Any] = {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
        "strategy": "block" if block else "channel", "group_size": None,
        "block_structure": [block, block] if block else None, "actorder": None, "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors", "format": "naive-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "naive-quantized"}},
    }


def pack_linear(prefix: str, codes: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": codes.contiguous(), f"{prefix}.weight_scale": scale.float().contiguous()}


def check_linear(prefix: str, parts: dict[str, torch.Tensor], cfg: Fp8Config, in_f: int, out_f: int,
                 file: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate one linear; return (codes as uint8 [out, in], scale fp32 expanded to [out, ceil(in/b)]
    for blocks, [out] per channel). Of the weight only the shape and dtype are read: it may be a
    ``LazyTensor``, returned unread, so that a tensor-parallel rank reads only its part of it."""
    w, s = parts.get("weight"), parts.get(cfg.scale_name)
    if w is None or s is None:
        raise ValueError(f"{file}: {prefix} needs {prefix}.weight and {prefix}.{cfg.scale_name}")
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{file}: {prefix}.weight has dtype {w.dtype}, expected float8_e4m3fn")
    if tuple(w.shape) != (out_f, in_f):
        raise ValueError(f"{file}: {prefix}.weight has shape {tuple(w.shape)}, expected {(out_f, in_f)}")
    s = s.float()
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"{file}: {prefix}.{cfg.scale_name} holds non-positive or non-finite scales")
    if cfg.block is None:
        if s.numel() == 1:
            s = s.reshape(1).expand(out_f).clone()
        elif tuple(s.shape) in ((out_f, 1), (out_f,)):
            s = s.reshape(out_f)
        else:
            raise ValueError(f"{file}: {prefix}.{cfg.scale_name} has shape {tuple(s.shape)}, expected "
                             f"({out_f}, 1) per channel or one value per tensor")
    else:
        b = cfg.block
        want = (-(-out_f // b), -(-in_f // b))
        if tuple(s.shape) != want:
            raise ValueError(f"{file}: {prefix}.{cfg.scale_name} has shape {tuple(s.shape)}, expected {want} "
                             f"for {b}x{b} blocks of a [{out_f} x {in_f}] weight")
        s = s.repeat_interleave(b, 0)[:out_f].contiguous()
    return (w if isinstance(w, LazyTensor) else w.view(torch.uint8)), s
