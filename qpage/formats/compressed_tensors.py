"""compressed-tensors ``pack-quantized`` INT4/INT8 weights (llm-compressor W4A16/W8A16; vLLM
loads them).

Per quantized linear ``<prefix>``:
- ``weight_packed`` int32 [out, ceil(in*bits/32)]: signed q in [-2^(b-1), 2^(b-1)) stored as
  q + 2^(b-1), packed along the input axis, element i at bit i*bits (the transpose of GPTQ);
- ``weight_scale`` [out, groups] ([out, 1] per channel);
- ``weight_zero_point`` (asymmetric only): signed zero points packed the same way along the
  output axis, [ceil(out*bits/32), groups];
- ``weight_shape`` int64 [out, in]; ``weight_g_idx`` int32 [in] with ``actorder: group``.
W = scale * (q - zero). At load the tensors become the GPTQ layout the kernels take: the
stored unsigned values are GPTQ's q, and the GPTQ zero is zero + 2^(b-1). The writer
(``pack_linear``) is the same map backwards, so a qpage INT checkpoint in this format holds
exactly the numbers of its GPTQ twin (scales stored fp16, as in the GPTQ format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qpage.formats.scheme import QuantScheme
from qpage.kernels.packing import pack_cols, pack_rows

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True)
class CtIntConfig:
    bits: int
    group_size: int | None
    sym: bool
    desc_act: bool = False

    @classmethod
    def from_weights(cls, w: dict[str, Any], fmt: str, where: str) -> CtIntConfig:
        bits, strategy = w.get("num_bits"), w.get("strategy")
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: compressed-tensors integer format {fmt!r} is not supported; qpage reads "
                             "pack-quantized")
        if bits not in (4, 8):
            raise ValueError(f"{where}: compressed-tensors int{bits} is not supported (4 or 8)")
        if strategy == "group":
            g = w.get("group_size")
            if g not in (32, 64, 128):
                raise ValueError(f"{where}: compressed-tensors group_size={g!r} is not supported (32, 64, 128)")
        elif strategy != "channel":
            raise ValueError(f"{where}: compressed-tensors strategy={strategy!r} is not supported for integers "
                             "(group or channel)")
        actorder = w.get("actorder")
        if actorder not in (None, "group", "static", "weight"):
            raise ValueError(f"{where}: compressed-tensors actorder={actorder!r} is not supported")
        return cls(bits, w.get("group_size") if strategy == "group" else None, bool(w.get("symmetric", True)),
                   actorder == "group")

    def wants(self, parts: dict[str, torch.Tensor]) -> bool:
        need = {"weight_packed", "weight_scale", "weight_shape"}
        if not self.sym:
            need.add("weight_zero_point")
        if self.desc_act:
            need.add("weight_g_idx")
        return need <= set(parts)


def _unpack_rows_dense(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, n] unsigned values, element i at bit i*bits (4 or 8 bits)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return vals.reshape(packed.shape[0], -1)[:, :n]


def check_linear(prefix: str, parts: dict[str, torch.Tensor], cfg: CtIntConfig, in_f: int, out_f: int,
                 file: str) -> dict[str, torch.Tensor]:
    """Validate one pack-quantized linear; return it in the GPTQ layout (v2 zeros)."""
    if not cfg.wants(parts):
        missing = sorted({"weight_packed", "weight_scale", "weight_shape"} - set(parts))
        raise ValueError(f"{file}: {prefix} lacks {', '.join(prefix + '.' + m for m in missing) or 'a tensor'}")
    b = cfg.bits
    shape = tuple(int(v) for v in parts["weight_shape"].tolist())
    if shape != (out_f, in_f):
        raise ValueError(f"{file}: {prefix}.weight_shape is {shape}, expected {(out_f, in_f)}")
    groups = -(-in_f // (cfg.group_size or in_f))
    want = {"weight_packed": (out_f, -(-in_f * b // 32)), "weight_scale": (out_f, groups)}
    if not cfg.sym:
        want["weight_zero_point"] = (-(-out_f * b // 32), groups)
    for s, sh in want.items():
        if tuple(parts[s].shape) != sh:
            raise ValueError(f"{file}: {prefix}.{s} has shape {tuple(parts[s].shape)}, expected {sh} for a "
                             f"{b}-bit [{out_f} x {in_f}] linear with group size {cfg.group_size or in_f}")
    if parts["weight_packed"].dtype != torch.int32:
        raise ValueError(f"{file}: {prefix}.weight_packed must be int32")
    q = _unpack_rows_dense(parts["weight_packed"], b, in_f).t()  # [in, out], GPTQ's unsigned q
    if cfg.sym:
        z = torch.full((groups, out_f), 2 ** (b - 1), dtype=torch.int32)
    else:
        z = _unpack_rows_dense(parts["weight_zero_point"].t().contiguous(), b, out_f)  # [groups, out]: zero + 2^(b-1)
    g_idx = parts.get("weight_g_idx")
    if g_idx is not None:
        if tuple(g_idx.shape) != (in_f,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{file}: {prefix}.weight_g_idx must be [{in_f}] with values in [0, {groups})")
        g_idx = None if torch.equal(g_idx.long(), torch.arange(in_f) // (cfg.group_size or in_f)) \
            else g_idx.to(torch.int32)
    return {"qweight": pack_rows(q.contiguous(), b), "qzeros": pack_cols(z.contiguous(), b),
            "scales": parts["weight_scale"].t().float().contiguous(), "g_idx": g_idx}


def quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    """compressed-tensors ``quantization_config`` for W4A16/W8A16 (what llm-compressor writes)."""
    weights: dict[str, Any] = {
        "num_bits": scheme.bits, "type": "int", "symmetric": scheme.sym, "dynamic": False,
        "strategy": "group" if scheme.group_size else "channel", "group_size": scheme.group_size,
        "block_structure": None, "actorder": "weight" if scheme.act_order else None, "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
    }


def pack_linear(prefix: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, sym: bool,
                group_size: int | None, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """pack-quantized tensors of one linear from GPTQ-convention q [in, out] (unsigned) and
    scales/zeros [groups, out]. compressed-tensors dropped ``actorder: group`` (a permuted
    g_idx) in 2026; act-order is written with static groups (``actorder: weight``), so
    ``g_idx``, if given, must be the plain one."""
    in_f, out_f = q.shape
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // (group_size or in_f)):
        raise ValueError(f"{prefix}: compressed-tensors cannot store a permuted g_idx; quantize with static "
                         "groups (--static-groups) or write --format gptq")
    t = {
        f"{prefix}.weight_packed": pack_cols(q.t().contiguous(), bits),
        f"{prefix}.weight_scale": scales.t().half().contiguous(),
        f"{prefix}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    if sym:
        if not bool((zeros == 2 ** (bits - 1)).all()):
            raise ValueError(f"{prefix}: a symmetric scheme produced zeros other than {2 ** (bits - 1)}")
    else:
        t[f"{prefix}.weight_zero_point"] = pack_cols(zeros.contiguous(), bits).t().contiguous()
    return t
