"""What a model step's C code shares with Python (``csrc/qp_step.h``): a projection over
block-format weights as C reads it, and whether a projection can run there. Used by the
mixture-of-experts block (``native_moe``) and the fused decode step (``native_decode``)."""

from __future__ import annotations

import ctypes

import torch

from qpage.kernels.cpu.matmul.native_gguf import PiecewiseMatmul

_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class CPiece(ctypes.Structure):
    """``qp_piece``: output columns [col0, col0 + n) on one packed weight."""

    _fields_ = [("type", _i32), ("pad", _i32), ("w", _p), ("n", _i64), ("col0", _i64)]


class CProj(ctypes.Structure):
    """``qp_proj``: a projection's pieces and an optional bias."""

    _fields_ = [("pieces", ctypes.POINTER(CPiece)), ("num_pieces", _i32), ("pad", _i32), ("bias", _p)]


def unfit_reason(mm: object) -> str | None:
    """Why a projection cannot run in the C step or block (None: it can)."""
    if not isinstance(mm, PiecewiseMatmul):
        return "it is not on the block-format kernels"
    if mm.input_perm is not None:
        return "its inputs are permuted (act-order)"
    return "a part of it is a float tensor" if mm.dense_pieces() else None


def c_proj(mm: PiecewiseMatmul, bias: torch.Tensor | None, keep: list[object]) -> CProj:
    """The C description of ``mm`` (its pieces array appended to ``keep``, which must outlive it)."""
    packed = mm.packed_pieces()
    pieces = (CPiece * len(packed))(*[CPiece(t, 0, w, n, c0) for c0, t, w, n in packed])
    keep.append(pieces)
    return CProj(pieces, len(pieces), 0, bias.data_ptr() if bias is not None else None)
