"""The AutoAWQ GEMM checkpoint format (``quant_method: "awq"``, ``version: "gemm"``).

Per quantized linear ``<prefix>``: ``qweight`` int32 [in, out/8] and ``qzeros``
int32 [groups, out/8], both packed along the output axis in the interleaved nibble order
0,2,4,6,1,3,5,7 (``kernels.packing.AWQ_ORDER``); ``scales`` fp16 [groups, out]; zeros
stored as they are. W[o, i] = scales[g, o] * (q[i, o] - z[g, o]) with g = i // group_size.
Only 4-bit exists. AutoAWQ itself refuses widths not divisible by the group; qpage reads a
partial last group (ceil(in/g) groups) like GPTQ's, but writes AWQ only when it divides.
At load the tensors are converted once to the GPTQ layout the kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qpage.formats.scheme import QuantScheme
from qpage.kernels.packing import pack_cols, pack_rows, unpack_cols


@dataclass(frozen=True)
class AwqConfig:
    bits: int
    group_size: int | None
    sym: bool = False
    desc_act: bool = False

    @classmethod
    def from_json(cls, qc: dict[str, Any], where: str) -> AwqConfig:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: AWQ bits={bits!r} is not supported (the GEMM format is 4-bit)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version={version!r} is not supported; qpage reads the GEMM layout")
        g = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(g, int) or (g != -1 and g not in (32, 64, 128)):
            raise ValueError(f"{where}: AWQ group_size={g!r} is not supported (32, 64, 128 or -1)")
        return cls(4, None if g == -1 else g)


def quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": scheme.bits, "group_size": scheme.group_size or -1,
            "zero_point": True, "version": "gemm", "modules_to_not_convert": None}


def check_writable(name: str, in_features: int, group_size: int | None) -> None:
    if group_size and in_features % group_size:
        raise ValueError(f"{name}: in_features={in_features} is not a multiple of group size {group_size}, which "
                         "the AWQ GEMM format (AutoAWQ, vLLM) requires; use --format gptq or a group size "
                         "that divides it")


def pack_linear(prefix: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int | None) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors from q [in, out] and scales/zeros [groups, out] (symmetric zeros stored as 8)."""
    check_writable(prefix, q.shape[0], group_size)
    return {f"{prefix}.qweight": pack_cols(q, 4, awq=True), f"{prefix}.qzeros": pack_cols(zeros, 4, awq=True),
            f"{prefix}.scales": scales.half().contiguous()}


def check_linear(prefix: str, parts: dict[str, torch.Tensor], cfg: AwqConfig, in_f: int, out_f: int,
                 file: str) -> dict[str, torch.Tensor]:
    """Validate one AWQ linear; return it in the GPTQ layout (v2 zeros) the kernels take."""
    missing = [s for s in ("qweight", "qzeros", "scales") if s not in parts]
    if missing:
        raise ValueError(f"{file}: {prefix} lacks {', '.join(prefix + '.' + m for m in missing)}")
    if out_f % 8:
        raise ValueError(f"{file}: {prefix} has {out_f} output features; AWQ packs 8 per int32")
    groups = -(-in_f // (cfg.group_size or in_f))
    want = {"qweight": (in_f, out_f // 8), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)}
    for s, shape in want.items():
        if tuple(parts[s].shape) != shape:
            raise ValueError(f"{file}: {prefix}.{s} has shape {tuple(parts[s].shape)}, expected {shape} for an AWQ "
                             f"4-bit [{out_f} x {in_f}] linear with group size {cfg.group_size or in_f}")
    if parts["qweight"].dtype != torch.int32 or parts["qzeros"].dtype != torch.int32:
        raise ValueError(f"{file}: {prefix}.qweight/qzeros must be int32")
    q = unpack_cols(parts["qweight"], 4, out_f, awq=True)
    z = unpack_cols(parts["qzeros"], 4, out_f, awq=True)
    return {"qweight": pack_rows(q, 4), "qzeros": pack_cols(z, 4), "scales": parts["scales"].to(torch.float16),
            "g_idx": None}
