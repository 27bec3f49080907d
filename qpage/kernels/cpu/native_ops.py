"""The small fp32 ops in C (``csrc/cpu_ops.c``): RMSNorm with the residual add, SiLU-and-mul,
rotary embedding and the integer cache's Hadamard rotation, each one call where torch runs
several small allocating ops."""

from __future__ import annotations

import torch

from qpage.kernels.cpu.native import load


def _rows_ok(x: torch.Tensor, width: int) -> bool:
    """fp32 on CPU, 2-D, ``width`` contiguous floats per row."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= width
            and (x.stride(1) == 1 or x.shape[1] == 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (dim,), weight, eps)`` for fp32 x [T, dim] (rows may be strided)."""
    lib = load()
    assert lib is not None, "rms_norm needs the native kernels; check load() first"
    t, dim = x.shape
    if not _rows_ok(x, dim) or not weight.is_contiguous() or weight.shape != (dim,):
        raise ValueError(f"rms_norm: unsupported input {tuple(x.shape)}/{x.stride()} {x.dtype}")
    out = torch.empty(t, dim, dtype=torch.float32)
    lib.qp_rms_norm_f32(x.data_ptr(), x.stride(0), out.data_ptr(), weight.data_ptr(), t, dim, eps)
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: each head of fp32 x [T, heads, hd] (each row's heads contiguous; rows may be
    strided) becomes ``rms_norm(head) * weight``."""
    lib = load()
    assert lib is not None, "rms_norm_heads_ needs the native kernels; check load() first"
    t, heads, hd = x.shape
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != hd
            or not weight.is_contiguous() or weight.shape != (hd,) or weight.dtype != torch.float32):
        raise ValueError(f"rms_norm_heads_: unsupported input {tuple(x.shape)}/{x.stride()} {x.dtype}")
    lib.qp_rms_norm_heads_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), t, heads, hd, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight`` (fp32 [T, dim], contiguous)."""
    lib = load()
    assert lib is not None, "add_rms_norm_ needs the native kernels; check load() first"
    t, dim = x.shape
    if (not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()) or residual.shape != x.shape
            or weight.shape != (dim,) or not _rows_ok(x, dim) or residual.dtype != torch.float32):
        raise ValueError(f"add_rms_norm_: unsupported inputs {tuple(x.shape)}, {tuple(residual.shape)}")
    lib.qp_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), t, dim, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for fp32 gate_up [T, 2 * inter] (gate first); returns [T, inter]."""
    return _gated("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` (GELU's tanh approximation) for fp32 gate_up [T, 2 * inter]; returns [T, inter]."""
    return _gated("gelu_tanh_mul", gate_up)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """``qp_<name>_f32`` over gate_up's rows: the activation of the gate half times the up half."""
    lib = load()
    assert lib is not None, f"{name} needs the native kernels; check load() first"
    t, width = gate_up.shape
    if not _rows_ok(gate_up, width) or width % 2:
        raise ValueError(f"{name}: unsupported input {tuple(gate_up.shape)}/{gate_up.stride()} {gate_up.dtype}")
    out = torch.empty(t, width // 2, dtype=torch.float32)
    getattr(lib, f"qp_{name}_f32")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, width // 2)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> None:
    """In place on the first ``heads`` heads of x fp32 [T, >= heads, hd]:
    ``apply_rotary`` with cos and signed_sin contiguous [T, hd] (rows of the rotary tables)."""
    lib = load()
    assert lib is not None, "rope_ needs the native kernels; check load() first"
    t, nh, hd = x.shape
    ok = (x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == hd
          and heads <= nh and cos.shape == (t, hd) and signed_sin.shape == (t, hd) and cos.is_contiguous()
          and signed_sin.is_contiguous() and cos.dtype == signed_sin.dtype == torch.float32)
    if not ok or lib.qp_rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), t, heads, hd):
        raise ValueError(f"rope_: unsupported input {tuple(x.shape)}/{x.stride()} with cos {tuple(cos.shape)}")


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """``kv_int.walsh_hadamard(x, block)`` bit for bit, for fp32 x [T, H, D] on CPU with heads
    contiguous (token rows may be strided); None where it cannot run (another layout, no C)."""
    lib = load()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 3 or x.stride(2) != 1
            or x.stride(1) != x.shape[2]):
        return None
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=torch.float32)
    if lib.qp_hadamard_f32(x.data_ptr(), x.stride(0), out.data_ptr(), t, h, d, block) != 0:
        return None
    return out
