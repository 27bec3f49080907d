"""FP8 (E4M3) weight linear layers, possibly fused from several projections.

Codes are kept as uint8 [out, in]; scales per output channel ``[out]`` or per 128x128 block,
kept expanded along the rows (``[out, ceil(in/128)]``) so that fused projections whose
boundaries do not fall on a 128-row block (q/k/v of small models) still load. Forward:
- CUDA with Triton: the fused FP8 matmul kernel (``kernels.fp8_matmul``), per channel, or
  with the block grid when every fused projection starts on a block boundary;
- otherwise the weight is dequantized once at ``prepare`` and multiplied like a dense layer
  (the CPU design; on CUDA a reported slow fallback).
"""

from __future__ import annotations

import torch

from qpage.formats.fp8 import Fp8Config, check_linear
from qpage.kernels.triton_utils import triton_unavailable_reason
from qpage.layers.quant_base import QuantLinearBase


class Fp8Linear(QuantLinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: Fp8Config) -> None:
        super().__init__(in_features, out_features, bias)
        self.cfg = cfg
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.uint8))
        scale_shape = (out_features, -(-in_features // cfg.block)) if cfg.block else (out_features,)
        self.register_buffer("scale", torch.ones(scale_shape, dtype=torch.float32))
        self.offsets: list[int] = []
        self._kernel_scale: torch.Tensor | None = None

    def wants(self, parts: dict[str, torch.Tensor]) -> bool:
        """Whether one projection's tensors are all there."""
        return "weight" in parts and self.cfg.scale_name in parts

    def load_part(self, prefix: str, parts: dict[str, torch.Tensor], offset: int, cols: int, file: str) -> None:
        codes, scale = check_linear(prefix, parts, self.cfg, self.in_features, cols, file)
        self.codes[offset : offset + cols] = codes
        self.scale[offset : offset + cols] = scale
        self.offsets.append(offset)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] fp32 weight."""
        w = self.codes.view(torch.float8_e4m3fn).float()
        if self.cfg.block is None:
            return w * self.scale[:, None]
        return w * self.scale.repeat_interleave(self.cfg.block, 1)[:, : self.in_features]

    def prepare(self, dtype: torch.dtype) -> None:
        dev = self.codes.device
        b = self.cfg.block
        if dev.type == "cuda" and triton_unavailable_reason("cuda") is None:
            if b is None:
                self._kernel_scale = self.scale
            elif all(off % b == 0 for off in self.offsets):
                self._kernel_scale = self.scale[::b].contiguous()  # the [ceil(out/b), ceil(in/b)] grid
            if self._kernel_scale is not None:
                self.kernel_path = "triton-fused"
                self.weight_bytes = self.codes.numel() + 4 * self._kernel_scale.numel()
                return
        self.use_dense(self.dequantized().t(), dtype)
        self.codes = torch.empty(0, dtype=torch.uint8)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        from qpage.kernels.fp8_matmul import fp8_matmul

        return fp8_matmul(x, self.codes, self._kernel_scale)
