"""Integer-weight linear layers (GPTQ layout), possibly fused from several projections.

The packed tensors are kept as loaded (``formats.gptq`` validates them and converts zeros
to the kernels' convention). Forward:
- CUDA: the Triton dequant-matmul kernels (``kernels.quant_matmul``);
- CPU: the weight is dequantized once at ``prepare`` into the model dtype and multiplied
  like a dense layer (NumPy's BLAS for fp32). That is the fastest CPU path for fp32
  activations (DESIGN 6: torch's int4/int8 packed kernels are fast only with bf16), at the
  cost of dense memory; the packed tensors are dropped then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qpage.formats.awq import AwqConfig
from qpage.formats.awq import check_linear as awq_check_linear
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.compressed_tensors import check_linear as ct_check_linear
from qpage.formats.gptq import GptqConfig, check_linear
from qpage.kernels import cpu_matmul
from qpage.kernels.quant_matmul import dequantize_ref, int_matmul
from qpage.kernels.triton_utils import triton_unavailable_reason


class IntLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 cfg: GptqConfig | AwqConfig | CtIntConfig) -> None:
        super().__init__()
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        pack = 32 // cfg.bits
        groups = -(-in_features // (cfg.group_size or in_features))
        self.register_buffer("qweight", torch.zeros(-(-in_features // pack), out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // pack, dtype=torch.int32))
        # GPTQ and AWQ store fp16 scales; compressed-tensors often fp32/bf16, kept exactly.
        scale_dtype = torch.float32 if isinstance(cfg, CtIntConfig) else torch.float16
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=scale_dtype))
        self.g_idx: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._dense: torch.Tensor | None = None
        self._w_t = None
        self._g_idx_set = False
        self.kernel_path = "unprepared"
        """How forward runs: triton-fused (CUDA), cpu-dequantized (CPU design), dequantized-fallback."""

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
            return
        # CPU by design; on CUDA without Triton a slow fallback (dense memory), which the
        # server's doctor reports through the kernel-path metric.
        self.kernel_path = "cpu-dequantized" if dev.type == "cpu" else "dequantized-fallback"
        w = dequantize_ref(self.qweight, self.scales, self.qzeros, self.g_idx, bits=self.cfg.bits,
                           group_size=self.cfg.group_size or self.in_features, in_features=self.in_features)
        if cpu_matmul.supports(dtype, dev):
            self._w_t = w.to(dtype).contiguous().numpy()  # [in, out]
        else:
            self._dense = w.t().to(dtype).contiguous()
        # The packed tensors are not needed any more on this path.
        self.qweight = self.qzeros = self.scales = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._w_t is not None:
            y = cpu_matmul.matmul_wt(x, self._w_t)
        elif self._dense is not None:
            y = F.linear(x, self._dense)
        else:
            y = int_matmul(x, self.qweight, self.scales, self.qzeros, self.g_idx, bits=self.cfg.bits,
                           group_size=self.cfg.group_size or self.in_features)
        return y + self.bias if self.bias is not None else y


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
