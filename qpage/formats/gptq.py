"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel; transformers and vLLM load it).

Per quantized linear ``<prefix>``: ``<prefix>.qweight`` int32 [in*bits/32, out]
packed along the input axis; ``<prefix>.qzeros`` int32 [groups, out*bits/32] packed along
the output axis; ``<prefix>.scales`` fp16 [groups, out]; ``<prefix>.g_idx`` int32 [in].
``config.json`` carries ``quantization_config`` with ``quant_method: "gptq"``, ``bits``,
``group_size`` (-1 = per channel), ``desc_act``, ``sym`` and ``checkpoint_format``:
- ``gptq`` (v1, what GPTQModel still saves and vLLM reads): qzeros hold zero - 1;
- ``gptq_v2``: qzeros hold the zero itself.
qpage writes v1 (its quantizers keep zeros >= 1 so v1 can hold them) and reads both,
converting v1 zeros to the kernels' v2 convention at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qpage.formats.scheme import QuantScheme
from qpage.kernels.packing import pack_cols, pack_rows, unpack_cols
from qpage.version import __version__

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    return {
        "quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size or -1,
        "desc_act": scheme.act_order, "static_groups": scheme.static_groups,
        "sym": scheme.sym, "checkpoint_format": "gptq", "pack_dtype": "int32",
        "lm_head": False, "true_sequential": True,
        "meta": {"quantizer": [f"qpage:{__version__}"], "method": scheme.method},
    }


def pack_linear(prefix: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group_size: int | None, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one linear from q [in, out], scales/zeros [groups, out] (g_idx: act-order)."""
    in_f = q.shape[0]
    if int(zeros.min()) < 1:
        raise ValueError(f"{prefix}: a zero of 0 cannot be stored in GPTQ v1 (zero - 1 would be -1)")
    return {
        f"{prefix}.qweight": pack_rows(q, bits),
        f"{prefix}.qzeros": pack_cols(zeros - 1, bits),
        f"{prefix}.scales": scales.half(),
        # A copy: fused projections share one g_idx, and safetensors refuses shared storage.
        f"{prefix}.g_idx": (g_idx if g_idx is not None else torch.arange(in_f) // (group_size or in_f)).to(
            torch.int32).clone(),
    }


@dataclass
class GptqConfig:
    bits: int
    group_size: int | None
    sym: bool
    desc_act: bool
    v1: bool

    @classmethod
    def from_json(cls, qc: dict[str, Any], where: str) -> GptqConfig:
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"{where}: GPTQ bits={bits!r} is not supported (4 or 8)")
        g = qc.get("group_size", -1)
        if not isinstance(g, int) or (g != -1 and g not in (32, 64, 128)):
            raise ValueError(f"{where}: GPTQ group_size={g!r} is not supported (32, 64, 128 or -1)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format={fmt!r} is not supported (gptq or gptq_v2)")
        return cls(bits, None if g == -1 else g, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                   fmt == "gptq")


def check_linear(prefix: str, parts: dict[str, torch.Tensor], cfg: GptqConfig, in_f: int, out_f: int,
                 file: str) -> dict[str, torch.Tensor]:
    """Validate one linear's tensors and return them in the kernels' convention (v2 zeros).
    Of ``qweight`` only the shape and dtype are read: it may be a ``LazyTensor``, returned
    unread, so that a tensor-parallel rank reads only its part of it."""
    missing = [s for s in SUFFIXES if s not in parts and s != "g_idx"]
    if missing:
        raise ValueError(f"{file}: {prefix} lacks {', '.join(prefix + '.' + m for m in missing)}")
    pack = 32 // cfg.bits
    groups = -(-in_f // (cfg.group_size or in_f))
    want = {"qweight": ((in_f + pack - 1) // pack, out_f), "qzeros": (groups, out_f // pack),
            "scales": (groups, out_f), "g_idx": (in_f,)}
    for s, shape in want.items():
        t = parts.get(s)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{file}: {prefix}.{s} has shape {tuple(t.shape)}, expected {shape} for a "
                             f"{cfg.bits}-bit [{out_f} x {in_f}] linear with group size {cfg.group_size or in_f}")
    if parts["qweight"].dtype != torch.int32 or parts["qzeros"].dtype != torch.int32:
        raise ValueError(f"{file}: {prefix}.qweight/qzeros must be int32")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{file}: {prefix}.g_idx has values outside [0, {groups}); the checkpoint is corrupt")
        default = torch.arange(in_f) // (cfg.group_size or in_f)
        g_idx = None if torch.equal(g_idx.long(), default) else g_idx.to(torch.int32)
    zeros = parts["qzeros"]
    if cfg.v1:  # stored zero - 1: unpack, add 1, repack (4-bit symmetric v1 reads 0x77777777)
        z = unpack_cols(zeros, cfg.bits, out_f) + 1
        zeros = pack_cols(z.clamp(0, 2**cfg.bits - 1), cfg.bits)
    return {"qweight": parts["qweight"], "qzeros": zeros, "scales": parts["scales"].to(torch.float16),
            "g_idx": g_idx}
