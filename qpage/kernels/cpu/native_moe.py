"""A mixture-of-experts block in one C call (``csrc/cpu_moe.c``): router, top-k, each chosen
expert's two projections over the rows routed to it, the weighted sum, and a shared expert.

It runs experts whose projections are all on the block-format kernels (``native_gguf``,
every piece packed, inputs in order; ``native_step``), the router in fp32. The fused decode
step (``native_decode``) calls the same block inside its layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from qpage.kernels.cpu.matmul.native_gguf import PiecewiseMatmul
from qpage.kernels.cpu.native import load
from qpage.kernels.cpu.native_step import CProj, c_proj, unfit_reason

_p, _i32 = ctypes.c_void_p, ctypes.c_int32


class CMoe(ctypes.Structure):
    """``qp_moe`` (``csrc/qp_step.h``)."""

    _fields_ = [("num_experts", _i32), ("top_k", _i32), ("inter", _i32), ("norm_topk", _i32),
                ("shared_inter", _i32), ("act", _i32), ("router", _p), ("gate_up", ctypes.POINTER(CProj)),
                ("down", ctypes.POINTER(CProj)), ("shared_gate_up", ctypes.POINTER(CProj)),
                ("shared_down", ctypes.POINTER(CProj)), ("shared_gate", _p), ("router_bias", _p),
                ("limit", ctypes.c_float), ("alpha", ctypes.c_float)]


@dataclass
class MoeWeights:
    """A sparse MLP as the C block reads it: router fp32 [experts, hidden] (contiguous); per
    expert its gate_up [2 inter, hidden] and down [hidden, inter]; an optional shared expert
    (gate_up, down) and its sigmoid gate fp32 [hidden]."""

    router: torch.Tensor
    experts: list[tuple[PiecewiseMatmul, PiecewiseMatmul]]
    top_k: int
    norm_topk: bool
    shared: tuple[PiecewiseMatmul, PiecewiseMatmul] | None = None
    shared_gate: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    """fp32 [experts] (gpt-oss)."""
    biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
    """Per expert, fp32 biases of gate_up [2 inter] and down [hidden] (gpt-oss), or None."""
    swiglu: tuple[float, float] | None = None
    """gpt-oss's clamped SwiGLU (limit, alpha); None: SiLU."""


def weights_unfit_reason(w: MoeWeights) -> str | None:
    """Why the C block cannot run these weights (None: it can)."""
    if w.router.dtype != torch.float32 or not w.router.is_contiguous() or w.router.device.type != "cpu":
        return "the router is not contiguous fp32 on the CPU"
    if w.router.dim() != 2 or w.router.shape[0] != len(w.experts) or not 0 < w.top_k <= len(w.experts):
        return f"a router of shape {tuple(w.router.shape)} for {len(w.experts)} experts, top {w.top_k}"
    if w.shared_gate is not None and w.shared_gate.numel() != w.router.shape[1]:
        return "the shared expert's gate is not one weight per hidden unit"
    for i, pair in enumerate([*w.experts, *([w.shared] if w.shared is not None else [])]):
        for mm in pair:
            why = unfit_reason(mm)
            if why is not None:
                return f"expert {i}: {why}"
    if w.shared is not None and (w.shared_gate is None or w.shared_gate.dtype != torch.float32
                                 or not w.shared_gate.is_contiguous()):
        return "the shared expert's gate is not contiguous fp32"
    vectors = [w.router_bias, *[b for pair in (w.biases or []) for b in pair]]
    if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in vectors):
        return "a bias is not contiguous fp32"
    return None


class MoeKernel:
    """x fp32 [rows, hidden] -> the block's output [rows, hidden], one C call."""

    def __init__(self, w: MoeWeights) -> None:
        why = weights_unfit_reason(w)
        if why is not None:
            raise ValueError(f"moe kernel: {why}")
        lib = load()
        assert lib is not None, "MoeKernel needs the native kernels; check load() first"
        lib.qp_moe_f32.argtypes = [ctypes.POINTER(CMoe), _p, ctypes.c_int, ctypes.c_int, _p, ctypes.c_int]
        lib.qp_moe_f32.restype = ctypes.c_int
        self._lib, self.weights = lib, w
        self.hidden = w.router.shape[1]
        self.threads = w.experts[0][0].threads
        self._keep: list[object] = [w]
        biases = w.biases or [(None, None)] * len(w.experts)
        gate_up = (CProj * len(w.experts))(*[c_proj(g, b, self._keep) for (g, _), (b, _) in zip(w.experts, biases,
                                                                                              strict=True)])
        down = (CProj * len(w.experts))(*[c_proj(d, b, self._keep) for (_, d), (_, b) in zip(w.experts, biases,
                                                                                            strict=True)])
        self._keep += [gate_up, down]
        shared_gu = shared_down = None
        shared_inter = 0
        if w.shared is not None:
            shared_gu = ctypes.pointer(c_proj(w.shared[0], None, self._keep))
            shared_down = ctypes.pointer(c_proj(w.shared[1], None, self._keep))
            shared_inter = w.shared[1].k
            self._keep += [shared_gu, shared_down]
        limit, alpha = w.swiglu or (0.0, 0.0)
        self.struct = CMoe(len(w.experts), w.top_k, w.experts[0][1].k, int(w.norm_topk), shared_inter,
                           int(w.swiglu is not None), w.router.data_ptr(), gate_up, down, shared_gu, shared_down,
                           None if w.shared_gate is None else w.shared_gate.data_ptr(),
                           None if w.router_bias is None else w.router_bias.data_ptr(), limit, alpha)
        """What ``qp_moe_f32`` reads (its arrays kept alive by this object)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.hidden).to(torch.float32).contiguous()
        out = torch.empty_like(x2)
        rc = self._lib.qp_moe_f32(ctypes.byref(self.struct), x2.data_ptr(), x2.shape[0], self.hidden,
                                  out.data_ptr(), self.threads)
        if rc != 0:
            why = "out of memory for its scratch" if rc == -3 else "a weight format this CPU cannot run"
            raise (MemoryError if rc == -3 else ValueError)(f"moe kernel: {why}")
        return out.reshape(shape).to(dtype)
