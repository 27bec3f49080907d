"""FP8 (E4M3) weight linear layers, possibly fused from several projections.

Codes are kept as uint8 [out, in]; scales per output channel ``[out]`` or per 128x128 block,
kept expanded along the rows (``[out, ceil(in/128)]``) so that fused projections whose
boundaries do not fall on a 128-row block (q/k/v of small models) still load. The kernel is
chosen at ``prepare`` (``linear_kernels``): the fused Triton FP8 matmul on CUDA (per channel,
or with the block grid when every fused projection starts on a block boundary), else the
weight dequantized once (the CPU path; on CUDA a reported slow fallback).
"""

from __future__ import annotations

from typing import Any

import torch

from qpage.formats.fp8 import Fp8Config, check_linear
from qpage.formats.safetensors_io import LazyTensor
from qpage.layers.linear.kernel_spec import LinearSpec
from qpage.layers.linear.quant_base import QuantLinearBase, Splitter


class Fp8Linear(QuantLinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: Fp8Config) -> None:
        super().__init__(in_features, out_features, bias)
        self.cfg = cfg
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.uint8))
        scale_shape = (out_features, -(-in_features // cfg.block)) if cfg.block else (out_features,)
        self.register_buffer("scale", torch.ones(scale_shape, dtype=torch.float32))
        self.offsets: list[int] = []

    def wants(self, parts: dict[str, torch.Tensor]) -> bool:
        """Whether one projection's tensors are all there."""
        return "weight" in parts and self.cfg.scale_name in parts

    def load_part(self, prefix: str, parts: dict[str, torch.Tensor], offset: int, cols: int, file: str) -> None:
        self.store_part(*self.check_part(prefix, parts, self.in_features, cols, file), offset, cols)

    def load_split(self, prefix: str, parts: dict[str, Any], offset: int, cols: int, file: str,
                   split: Splitter) -> torch.Tensor | None:
        """A split model's ``load_part``: this rank's part (``Splitter``); returns its input columns."""
        codes, scale = self.check_part(prefix, parts, *split.whole_shape(prefix), file)
        codes, scale, inputs = split.fp8_part(prefix, codes, scale, self.cfg.block)
        self.store_part(codes, scale, offset, cols)
        return inputs

    def unread_parts(self) -> tuple[str, ...]:
        """The codes, sliced before they are read (their validation needs only shape and dtype)."""
        return ("weight",)

    def check_part(self, prefix: str, parts: dict[str, torch.Tensor], in_features: int, cols: int,
                   file: str) -> tuple[torch.Tensor | LazyTensor, torch.Tensor]:
        """One projection's (codes [cols, in_features], scale), validated
        (``formats.fp8.check_linear``'s layout: the codes unread when given unread)."""
        return check_linear(prefix, parts, self.cfg, in_features, cols, file)

    def store_part(self, codes: torch.Tensor, scale: torch.Tensor, offset: int, cols: int) -> None:
        """Copy ``check_part``'s result into output rows [offset, offset + cols)."""
        self.codes[offset : offset + cols] = codes
        self.scale[offset : offset + cols] = scale
        self.offsets.append(offset)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] fp32 weight."""
        w = self.codes.view(torch.float8_e4m3fn).float()
        if self.cfg.block is None:
            return w * self.scale[:, None]
        return w * self.scale.repeat_interleave(self.cfg.block, 1)[:, : self.in_features]

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        b = self.cfg.block
        aligned = b is None or all(off % b == 0 for off in self.offsets)
        return LinearSpec("fp8", self.codes.device, dtype, self.in_features, self.out_features,
                          fp8_block_aligned=aligned)

    def dequantized_in_out(self) -> torch.Tensor:
        return self.dequantized().t()

    def drop_packed(self) -> None:
        self.codes = torch.empty(0, dtype=torch.uint8)
