"""Integer-weight linear layers (GPTQ layout), possibly fused from several projections.

The packed tensors are kept as loaded (``formats.gptq`` validates them and converts zeros
to the kernels' convention); the kernel is chosen at ``prepare`` (``linear_kernels``): the
Triton kernels on CUDA, the block kernels on CPU (the weight written once as Q4_0/Q4_1/Q8_0
blocks), torch's packed kernels for what has no block form, else the weight dequantized once.
"""

from __future__ import annotations

from typing import Any

import torch

from qpage.formats.awq import AwqConfig
from qpage.formats.awq import check_linear as awq_check_linear
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.compressed_tensors import check_linear as ct_check_linear
from qpage.formats.gptq import GptqConfig, check_linear
from qpage.kernels.packing import dequantize_ref, unpack_cols
from qpage.layers.linear.kernel_spec import LinearSpec
from qpage.layers.linear.quant_base import QuantLinearBase, Splitter


class IntLinear(QuantLinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 cfg: GptqConfig | AwqConfig | CtIntConfig) -> None:
        super().__init__(in_features, out_features, bias)
        self.cfg = cfg
        pack = 32 // cfg.bits
        groups = -(-in_features // (cfg.group_size or in_features))
        self.register_buffer("qweight", torch.zeros(-(-in_features // pack), out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // pack, dtype=torch.int32))
        # GPTQ and AWQ store fp16 scales; compressed-tensors often fp32/bf16, kept exactly.
        scale_dtype = torch.float32 if isinstance(cfg, CtIntConfig) else torch.float16
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=scale_dtype))
        self.g_idx: torch.Tensor | None = None
        self._g_idx_set = False

    def wants(self, parts: dict[str, torch.Tensor]) -> bool:
        """Whether one projection's tensors are all there (GPTQ has g_idx, AWQ has not)."""
        if isinstance(self.cfg, CtIntConfig):
            return self.cfg.wants(parts)
        return len(parts) == (3 if isinstance(self.cfg, AwqConfig) else 4)

    def load_part(self, prefix: str, parts: dict[str, torch.Tensor], offset: int, cols: int, file: str) -> None:
        """Copy one projection's tensors into output columns [offset, offset + cols)."""
        self.store_part(prefix, self.check_part(prefix, parts, self.in_features, cols, file), offset, cols, file)

    def load_split(self, prefix: str, parts: dict[str, Any], offset: int, cols: int, file: str,
                   split: Splitter) -> torch.Tensor | None:
        """A split model's ``load_part``: this rank's part (``Splitter``); returns its input columns."""
        whole = self.check_part(prefix, parts, *split.whole_shape(prefix), file)
        part, inputs = split.int_part(prefix, whole, self.cfg)
        self.store_part(prefix, part, offset, cols, file)
        return inputs

    def unread_parts(self) -> tuple[str, ...]:
        """The tensors a split model slices before reading them: GPTQ's qweight, whose
        validation needs only its shape and dtype (the others are read whole, one projection
        at a time)."""
        return ("qweight",) if isinstance(self.cfg, GptqConfig) else ()

    def check_part(self, prefix: str, parts: dict[str, torch.Tensor], in_features: int, cols: int,
                   file: str) -> dict[str, torch.Tensor]:
        """One projection's tensors, as stored in the checkpoint, validated for an
        [in_features -> cols] projection and converted to the GPTQ layout (v2 zeros)."""
        if isinstance(self.cfg, AwqConfig):
            return awq_check_linear(prefix, parts, self.cfg, in_features, cols, file)
        if isinstance(self.cfg, CtIntConfig):
            return ct_check_linear(prefix, parts, self.cfg, in_features, cols, file)
        return check_linear(prefix, parts, self.cfg, in_features, cols, file)

    def store_part(self, prefix: str, t: dict[str, torch.Tensor | None], offset: int, cols: int, file: str) -> None:
        """Copy a projection in the GPTQ layout (``check_part``'s result) into output columns
        [offset, offset + cols)."""
        pack = 32 // self.cfg.bits
        self.qweight[:, offset : offset + cols] = t["qweight"]
        self.qzeros[:, offset // pack : (offset + cols) // pack] = t["qzeros"]
        self.scales[:, offset : offset + cols] = t["scales"]
        g = t["g_idx"]
        if self._g_idx_set and not _same(self.g_idx, g):
            raise ValueError(f"{file}: {prefix}.g_idx differs from the other projections fused with it; "
                             "qpage needs projections that share an input to share g_idx")
        self.g_idx, self._g_idx_set = g, True

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        zeros = unpack_cols(self.qzeros, self.cfg.bits, self.out_features)
        return LinearSpec("int", self.qweight.device, dtype, self.in_features, self.out_features, bits=self.cfg.bits,
                          group_size=self.cfg.group_size or self.in_features, g_idx=self.g_idx,
                          symmetric=bool((zeros == 1 << (self.cfg.bits - 1)).all()))

    def dequantized_in_out(self) -> torch.Tensor:
        return dequantize_ref(self.qweight, self.scales, self.qzeros, self.g_idx, bits=self.cfg.bits,
                              group_size=self.cfg.group_size or self.in_features, in_features=self.in_features)

    def drop_packed(self) -> None:
        self.qweight = self.qzeros = self.scales = torch.empty(0)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
