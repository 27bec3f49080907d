"""The model's small ops, chosen once per model at ``prepare``: RMSNorm (with vLLM's fused
residual add), SiLU-and-mul and GELU-and-mul, and rotary on the q/k heads of the fused qkv projection.

``select_ops`` returns the first implementation that can run the model's device and dtype:
the C kernels (``kernels.cpu.native``) for fp32 on CPU, which work in place and in one call
each; torch's ops otherwise. ``torch_threads``: on the fp32 CPU path the matmuls run on
NumPy's BLAS threads, and torch's OpenMP threads spinning between ops steal those cores
(decode several times slower with both on all cores), so torch's own ops run on one thread.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from qpage.kernels.cpu import native, native_ops
from qpage.kernels.cpu.matmul import blas
from qpage.layers.rotary import apply_rotary

logger = logging.getLogger("qpage")


class TorchOps:
    """Plain torch: any device and dtype; norms in fp32 like the reference implementations."""

    name = "torch"
    torch_threads: int | None = None
    """The thread count torch's own ops should use on this path (None: leave it)."""

    def can_implement(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # Half precision: normalise in fp32, round, then scale (as the reference models do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual``; returns ``(rms_norm(residual), residual)``."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: each head of x [T, heads, head_dim] normalised (q/k norms)."""
        x.copy_(self.rms_norm(x, weight, eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of gate_up [T, 2 * inter] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate) * up`` with GELU's tanh approximation (GeGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q [T, nq, hd] and k [T, nkv, hd] from the first nq + nkv heads of qkv (one
        rotary call over both); cos and sin as ``RotaryEmbedding.lookup`` returns them."""
        qk = apply_rotary(qkv[:, : nq + nkv], cos, sin)
        return qk[:, :nq], qk[:, nq:]


class CpuBlasOps(TorchOps):
    """fp32 on CPU without the C kernels: torch's ops on one thread beside NumPy's BLAS."""

    name = "cpu-blas"
    torch_threads = 1

    def can_implement(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None if blas.supports(dtype, device) else "needs fp32 on cpu"


class CpuNativeOps(CpuBlasOps):
    """fp32 on CPU with the C kernels: the residual add and norm in place, rotary in place on
    the projection's output."""

    name = "cpu-native"

    def can_implement(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return super().can_implement(device, dtype) or native.unavailable_reason()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return native_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: ``residual += x``, ``x = rms_norm(residual)``; returns ``(x, residual)``."""
        native_ops.add_rms_norm_(x, residual, weight, eps)
        return x, residual

    def rms_norm_heads_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        native_ops.rms_norm_heads_(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return native_ops.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return native_ops.gelu_tanh_mul(gate_up)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        native_ops.rope_(qkv, cos.view(t, -1), sin.view(t, -1), nq + nkv)
        return qkv[:, :nq], qkv[:, nq : nq + nkv]


MODEL_OPS: tuple[TorchOps, ...] = (CpuNativeOps(), CpuBlasOps(), TorchOps())
TORCH_OPS = MODEL_OPS[-1]


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The first of ``MODEL_OPS`` that can run ``dtype`` on ``device`` (torch always can)."""
    for ops in MODEL_OPS:
        why = ops.can_implement(device, dtype)
        if why is None:
            return ops
        logger.debug("model ops: skipped %s: %s", ops.name, why)
    raise AssertionError("TorchOps runs everywhere")
