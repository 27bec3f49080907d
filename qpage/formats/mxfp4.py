"""gpt-oss's MXFP4 safetensors (``quantization_config.quant_method == "mxfp4"``).

The experts are stored stacked per layer and projection, in OCP MX blocks of 32 inputs:
``mlp.experts.{gate_up_proj,down_proj}_blocks`` uint8 [experts, out rows, in / 32, 16] hold E2M1
codes (input 2j of a block in byte j's low nibble, 2j + 1 in its high one) and ``*_scales``
uint8 [experts, out rows, in / 32] an E8M0 exponent per block (the block's weights are
code value x 2^(e - 127)). Every other linear (attention, router, embedding, head: the
config's ``modules_to_not_convert``) is a float tensor.

``models.moe`` splits the stacked tensors per expert; here each expert's projection becomes
llama.cpp's MXFP4 block (a ``GgufTensor`` of ggml type 39, 17 bytes a block: the exponent
byte, then input j in byte j's low nibble and j + 16 in its high one). The codes and
exponents are kept, only the nibbles move (ggml's E2M1 table holds twice the values and its
exponent means 2^(e - 128)), so the experts run packed on the block kernels as a GGUF file's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from qpage.formats.gguf_model import GgufTensor

GGML_MXFP4 = int(GGMLQuantizationType.MXFP4)
BLOCK = 32
"""Inputs per block."""


@dataclass(frozen=True)
class Mxfp4Config:
    """The ``quantization_config`` of an MXFP4 checkpoint: each linear is MX blocks (``weight``
    uint8 codes and ``weight_scale`` exponents, as ``models.moe`` names an expert's split
    tensors) or a float ``weight``."""

    quant_method: str = "mxfp4"

    @classmethod
    def from_json(cls, qc: dict[str, Any], where: str) -> Mxfp4Config:
        block = qc.get("block_size", BLOCK)
        if block != BLOCK:
            raise ValueError(f"{where}: quantization_config block_size={block!r}; MXFP4 checkpoints have blocks of "
                             f"{BLOCK}")
        return cls()

    def wants(self, parts: dict[str, Any]) -> bool:
        """Whether one linear's tensors are all there: a float weight, or codes and exponents."""
        w = parts.get("weight")
        return w is not None and (w.dtype.is_floating_point or "weight_scale" in parts)

    def linear_part(self, prefix: str, parts: dict[str, Any], in_f: int, out_f: int, file: str
                    ) -> GgufTensor | torch.Tensor:
        """The linear's weight: MXFP4 blocks as ggml lays them out, or fp32 [out, in]."""
        w = _read(parts["weight"])
        if w.is_floating_point():
            if set(parts) != {"weight"}:
                raise ValueError(f"{file}: {prefix} has a float weight and {sorted(set(parts) - {'weight'})}; an "
                                 "MXFP4 checkpoint's linear is either float or MX blocks")
            return w.float()
        if "weight_scale" not in parts:
            raise ValueError(f"{file}: {prefix} has MXFP4 codes but no exponents (*_scales); the checkpoint is "
                             "incomplete")
        scales = _read(parts["weight_scale"])
        groups = in_f // BLOCK
        if in_f % BLOCK or w.dtype != torch.uint8 or tuple(w.shape) != (out_f, groups, BLOCK // 2):
            raise ValueError(f"{file}: {prefix} MXFP4 codes are {w.dtype} {tuple(w.shape)}; expected uint8 "
                             f"{(out_f, groups, BLOCK // 2)} for a [{out_f} x {in_f}] weight")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (out_f, groups):
            raise ValueError(f"{file}: {prefix} MXFP4 exponents are {scales.dtype} {tuple(scales.shape)}; expected "
                             f"uint8 {(out_f, groups)}")
        return GgufTensor(ggml_rows(w.numpy(), scales.numpy()), GGML_MXFP4, (out_f, in_f), prefix)


def ggml_rows(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, groups, 16] (pairs 2j, 2j + 1 in byte j) and exponents [rows, groups]
    -> ggml MXFP4 rows [rows, groups * 17] (exponent, then pairs j, j + 16 in byte j)."""
    rows, groups = exponents.shape
    nibbles = np.empty((rows, groups, BLOCK), dtype=np.uint8)
    nibbles[..., 0::2] = codes & 0x0F
    nibbles[..., 1::2] = codes >> 4
    out = np.empty((rows, groups, 1 + BLOCK // 2), dtype=np.uint8)
    out[..., 0] = exponents
    out[..., 1:] = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
    return out.reshape(rows, -1)


def _read(t: Any) -> torch.Tensor:
    """A part as a tensor (a safetensors ``LazyTensor`` is read)."""
    return t if isinstance(t, torch.Tensor) else t.read()
