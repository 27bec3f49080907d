"""Kernel backends declare what they support, as data; selectors try them in order.

A selector returns the first backend whose capabilities fit the device, dtype, cache
format and shapes. Backends passed over are logged with the reason, and when the caller
asked for one by name that does not fit, the error lists every reason and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qpage.config import ATTENTION_BACKENDS, INT_BITS
from qpage.kernels.cpu import native
from qpage.kernels.triton_utils import INSTALLED, INTERPRET
from qpage.layers.attention.backends import CpuBlasPagedAttention, CpuNativePagedAttention, TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.triton_backend import TritonPagedAttention

logger = logging.getLogger("qpage")

FEATURES = ("sliding-window", "softcap", "sinks")
"""What a model may ask of attention beyond plain causal attention: layers that attend to a
sliding window of positions, scores soft-capped before the softmax (Gemma), a learned sink
logit per head in the softmax (gpt-oss)."""


@dataclass(frozen=True)
class AttentionCapabilities:
    name: str
    devices: tuple[str, ...]
    """torch device types it runs on."""
    dtypes: tuple[torch.dtype, ...]
    kv_formats: tuple[str | None, ...]
    """Cache formats: None (model dtype), "e4m3", "e5m2", "int8", "int4", "k8v4" (``KVCacheSpec.format``)."""
    max_head_dim: int
    needs_triton: bool
    auto: bool
    """Whether ``auto`` may pick it (the interpreter is for tests: only by name)."""
    make: Callable[[KVCacheSpec], object]
    """The backend for a cache format (it binds its kernels to the format once)."""
    unavailable: Callable[[], str | None] | None = None
    """Why it cannot run in this process (e.g. its native code did not build), or None."""
    features: frozenset[str] = frozenset()
    """Which of ``FEATURES`` it implements."""

    def reject(self, device: torch.device, spec: KVCacheSpec, head_dim: int, by_name: bool,
               needs: frozenset[str] = frozenset()) -> str | None:
        """Why this backend does not fit, or None."""
        if self.needs_triton and not INSTALLED:
            return "Triton is not installed (pip install triton)"
        dev_ok = device.type in self.devices or (self.needs_triton and INTERPRET and by_name)
        if not dev_ok:
            hint = "; set TRITON_INTERPRET=1 to run it on CPU in the interpreter" if self.needs_triton else ""
            return f"runs on {'/'.join(self.devices)}, not {device.type}{hint}"
        if spec.dtype not in self.dtypes:
            return f"supports dtypes {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)}, not {spec.dtype}"
        if spec.format not in self.kv_formats:
            return f"does not read a kv cache of {spec.describe()}"
        if head_dim > self.max_head_dim:
            return f"head_dim {head_dim} > {self.max_head_dim}"
        if needs - self.features:
            return f"does not implement {', '.join(sorted(needs - self.features))} attention, which the model needs"
        if not by_name and not self.auto:
            return "picked only by name"
        return self.unavailable() if self.unavailable is not None else None


ALL_KV = (None, "e4m3", "e5m2", *INT_BITS)
ATTENTION_CAPABILITIES = (
    AttentionCapabilities("triton", ("cuda",), (torch.float16, torch.bfloat16, torch.float32), ALL_KV, 256,
                          needs_triton=True, auto=True, make=TritonPagedAttention),
    AttentionCapabilities("cpu-native", ("cpu",), (torch.float32,), ALL_KV, 1024, needs_triton=False, auto=True,
                          make=CpuNativePagedAttention, unavailable=native.unavailable_reason,
                          features=frozenset(FEATURES)),
    AttentionCapabilities("cpu-blas", ("cpu",), (torch.float32,), ALL_KV, 1024,
                          needs_triton=False, auto=True, make=CpuBlasPagedAttention),
    AttentionCapabilities("torch", ("cpu", "cuda", "mps"), (torch.float16, torch.bfloat16, torch.float32), ALL_KV,
                          1024, needs_triton=False, auto=True, make=TorchPagedAttention, features=frozenset(FEATURES)),
)


def select_attention_backend(device: torch.device, spec: KVCacheSpec, head_dim: int, prefer: str = "auto",
                             needs: frozenset[str] = frozenset()) -> object:
    """The first backend that fits (``prefer`` = a name to insist on one) and implements
    ``needs`` (of ``FEATURES``)."""
    if prefer not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={prefer!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    reasons = []
    for cap in ATTENTION_CAPABILITIES:
        if prefer != "auto" and cap.name != prefer:
            continue
        why = cap.reject(device, spec, head_dim, by_name=prefer != "auto", needs=needs)
        if why is None:
            for r in reasons:
                logger.info("attention: skipped %s", r)
            return cap.make(spec)
        reasons.append(f"{cap.name}: {why}")
    raise ValueError(
        f"no attention backend fits device={device.type}, dtype={spec.dtype}, kv cache {spec.describe()}, "
        f"head_dim={head_dim}{', ' + ', '.join(sorted(needs)) if needs else ''}: " + "; ".join(reasons)
        + ". Use attention_backend='auto' or another device/dtype."
    )
