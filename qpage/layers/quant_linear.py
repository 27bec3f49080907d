"""Integer-weight linear layers (GPTQ layout), possibly fused from several projections.

The packed tensors are kept as loaded (``formats.gptq`` validates them and converts zeros
to the kernels' convention). Forward:
- CUDA: the Triton dequant-matmul kernels (``kernels.quant_matmul``);
- CPU with bf16 activations: torch's packed int4/int8 kernels (``kernels.cpu_packed``),
  the weight staying at 4 or 8 bits in memory;
- CPU with fp32 (the default dtype there) or fp16 activations: the weight is dequantized once at
  ``prepare`` and multiplied like a dense layer through NumPy's BLAS. That is the fastest
  fp32 CPU path (torch's packed kernels run 10-60x slower with fp32 activations,
  DESIGN 6), at the cost of dense memory. ``benchmarks/cpu_paths.py`` measures both.
"""

from __future__ import annotations

import functools
import logging

import torch

from qpage.formats.awq import AwqConfig
from qpage.formats.awq import check_linear as awq_check_linear
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.compressed_tensors import check_linear as ct_check_linear
from qpage.formats.gptq import GptqConfig, check_linear
from qpage.kernels import cpu_packed
from qpage.kernels.quant_matmul import dequantize_ref, int_matmul, unpack_cols, unpack_rows
from qpage.kernels.triton_utils import triton_unavailable_reason
from qpage.layers.quant_base import QuantLinearBase

logger = logging.getLogger("qpage")


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
        if isinstance(self.cfg, AwqConfig):
            t = awq_check_linear(prefix, parts, self.cfg, self.in_features, cols, file)
        elif isinstance(self.cfg, CtIntConfig):
            t = ct_check_linear(prefix, parts, self.cfg, self.in_features, cols, file)
        else:
            t = check_linear(prefix, parts, self.cfg, self.in_features, cols, file)
        pack = 32 // self.cfg.bits
        self.qweight[:, offset : offset + cols] = t["qweight"]
        self.qzeros[:, offset // pack : (offset + cols) // pack] = t["qzeros"]
        self.scales[:, offset : offset + cols] = t["scales"]
        g = t["g_idx"]
        if self._g_idx_set and not _same(self.g_idx, g):
            raise ValueError(f"{file}: {prefix}.g_idx differs from the other projections fused with it; "
                             "qpage needs projections that share an input to share g_idx")
        self.g_idx, self._g_idx_set = g, True

    def prepare(self, dtype: torch.dtype) -> None:
        dev = self.qweight.device
        if dev.type == "cuda" and triton_unavailable_reason("cuda") is None:
            self.kernel_path = "triton-fused"
            self.weight_bytes = sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))
            return
        group = self.cfg.group_size or self.in_features
        if not (dev.type == "cpu" and self._pack_cpu(dtype, group)):
            # fp32 on CPU by design; on CUDA without Triton a slow fallback (dense memory),
            # which the server's doctor reports through the kernel-path metric.
            self.use_dense(dequantize_ref(self.qweight, self.scales, self.qzeros, self.g_idx, bits=self.cfg.bits,
                                          group_size=group, in_features=self.in_features), dtype)
        self.qweight = self.qzeros = self.scales = torch.empty(0)  # not needed on these paths

    def _pack_cpu(self, dtype: torch.dtype, group: int) -> bool:
        """Repack for torch's CPU int4/int8 kernels when they fit (bf16 activations)."""
        bits = self.cfg.bits
        why = cpu_packed.packed_reason(bits, group, self.g_idx, self.in_features, self.out_features, dtype)
        if why is not None:
            logger.debug("int%d linear [%d -> %d] dequantized on CPU: %s", bits, self.in_features,
                         self.out_features, why)
            return False
        q = unpack_rows(self.qweight, bits, self.in_features)
        zeros = unpack_cols(self.qzeros, bits, self.out_features)
        if bits == 4:
            p4 = cpu_packed.pack_int4(q, self.scales, zeros, self.g_idx, group, dtype)
            self.use_packed("cpu-int4pack", functools.partial(cpu_packed.int4_mm, p=p4), p4.nbytes())
        else:
            p8 = cpu_packed.pack_int8(q, self.scales, zeros, dtype)
            self.use_packed("cpu-int8pack", functools.partial(cpu_packed.int8_mm, p=p8), p8.nbytes())
        return True

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return int_matmul(x, self.qweight, self.scales, self.qzeros, self.g_idx, bits=self.cfg.bits,
                          group_size=self.cfg.group_size or self.in_features)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
