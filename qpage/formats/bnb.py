"""bitsandbytes 4-bit checkpoints as transformers saves them (``quant_method: "bitsandbytes"``,
``load_in_4bit``): read, and written by ``qpage quantize --scheme nf4``.

Per quantized linear ``<prefix>`` (W [out, in] flattened row-major, in blocks of ``blocksize``):
- ``weight`` uint8 [out * in / 2, 1]: two 4-bit codes per byte, the first in the high nibble;
- ``weight.quant_map`` fp32 [16]: the codebook (NF4 or FP4, values in [-1, 1]);
- ``weight.absmax``: per block, fp32; with double quantization uint8 codes into
  ``weight.nested_quant_map`` fp32 [256], scaled per 256 blocks by ``weight.nested_absmax``;
- ``weight.quant_state.bitsandbytes__nf4`` (``__fp4``): the bytes of a JSON object with
  quant_type, blocksize, dtype, shape, and nested_blocksize and nested_offset when nested.
W = quant_map[code] * absmax[block], where a nested absmax is
nested_quant_map[a] * nested_absmax[block // nested_blocksize] + nested_offset.

At load a linear becomes a ``Bnb4Tensor``: the CPU kernels' NF4/FP4 blocks (an fp16
d = absmax / c per 32 weights, the codebook times c rounded, ``KERNEL_SCALE``; a weight moves
by about 0.004 of its block's absmax at most), with the exact absmax kept for ``dequantize``, the
reference. When blocks cannot hold it (a block across two rows, a codebook that is not
bitsandbytes' own, a scale outside fp16's normal range) the linear is dequantized in fp32 and
the reason logged. The writer stores NF4 with fp32 absmax per 64 weights (no nesting).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qpage.formats.gguf_model import GgufTensor
from qpage.kernels.cpu.matmul.native_gguf import FP4, NF4

logger = logging.getLogger("qpage")

CODEBOOKS = {
    "nf4": np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                     0.7229568362236023, 1.0], dtype=np.float32),
    "fp4": np.array([0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25, 0.0, -0.005208333333,
                     -0.66666667, -1.0, -0.33333333, -0.5, -0.16666667, -0.25], dtype=np.float32),
}
"""bitsandbytes' codebooks (``quant_map``)."""
KERNEL_TYPES = {"nf4": NF4, "fp4": FP4}
KERNEL_SCALE = {"nf4": 112.0, "fp4": 120.0}
"""The kernels hold round(codebook * c) as int8 and d = absmax / c; these c round each codebook
with the least mean squared error (FP4's exactly but for its 0.0052)."""
BLOCKSIZE = 64
"""The block the writer uses (bitsandbytes' default for 4-bit)."""
_PART = re.compile(r"^(.+)\.(weight\.(?:absmax|quant_map|nested_absmax|nested_quant_map|"
                   r"quant_state\.bitsandbytes__(?:nf4|fp4)))$")
SUFFIXES = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
            "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4")


def split_name(name: str) -> tuple[str, str] | None:
    """(linear prefix, part) of a bitsandbytes quant-state tensor name, else None."""
    m = _PART.match(name)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class BnbConfig:
    quant_type: str
    """``nf4`` or ``fp4``."""
    nested: bool
    """Double quantization: absmax stored as uint8 codes."""

    @classmethod
    def from_json(cls, qc: dict[str, Any], where: str) -> BnbConfig:
        if qc.get("load_in_8bit"):
            raise ValueError(f"{where}: bitsandbytes 8-bit (LLM.int8) checkpoints are not supported; qpage reads "
                             "bitsandbytes 4-bit (NF4/FP4), or quantize the original with `qpage quantize`")
        if not qc.get("load_in_4bit"):
            raise ValueError(f"{where}: a bitsandbytes quantization_config without load_in_4bit is not supported")
        qt = qc.get("bnb_4bit_quant_type", "fp4")
        if qt not in CODEBOOKS:
            raise ValueError(f"{where}: bnb_4bit_quant_type={qt!r} is not supported (nf4 or fp4)")
        storage = qc.get("bnb_4bit_quant_storage", "uint8")
        if storage != "uint8":
            raise ValueError(f"{where}: bnb_4bit_quant_storage={storage!r} is not supported; qpage reads uint8")
        return cls(qt, bool(qc.get("bnb_4bit_use_double_quant", False)))

    def wants(self, parts: dict[str, torch.Tensor]) -> bool:
        need = {"weight", "weight.absmax", "weight.quant_map", f"weight.quant_state.bitsandbytes__{self.quant_type}"}
        if self.nested:
            need |= {"weight.nested_absmax", "weight.nested_quant_map"}
        return need <= parts.keys()

    def linear_part(self, prefix: str, parts: dict[str, torch.Tensor], in_f: int, out_f: int,
                    file: str) -> Bnb4Tensor | torch.Tensor:
        """The linear's weight as kernel blocks, or fp32 (``check_linear``)."""
        return check_linear(prefix, parts, self, in_f, out_f, file)


def quantization_config() -> dict[str, Any]:
    """What transformers writes for NF4 without nesting (fp32 compute)."""
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "float32",
            "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0,
            "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}


@dataclass
class Bnb4Tensor(GgufTensor):
    """A bitsandbytes 4-bit weight as kernel blocks (``rows``: NF4/FP4, see the module note),
    with what its exact dequantization needs."""

    absmax: np.ndarray
    """fp32 [out, in / blocksize]."""
    codebook: np.ndarray
    """fp32 [16]: the checkpoint's quant_map."""

    def block(self) -> tuple[int, int]:
        return 32, 18

    def take_rows(self, a: int, b: int) -> Bnb4Tensor:
        return dataclasses.replace(self, rows=self.rows[a:b], shape=(b - a, self.shape[1]), absmax=self.absmax[a:b])

    def take_cols(self, a: int, b: int) -> Bnb4Tensor:
        """Input columns [a, b) on 32-weight blocks: the absmax goes per 32 weights first, so
        a cut inside a bitsandbytes block of 64 keeps each weight's exact scale."""
        part = super().take_cols(a, b)
        per32 = np.repeat(self.absmax, self.shape[1] // 32 // self.absmax.shape[1], axis=1)
        return dataclasses.replace(part, absmax=per32[:, a // 32 : b // 32])

    def dequantize(self) -> torch.Tensor:
        out_f, in_f = self.shape
        nb = in_f // 32
        blocks = self.rows.reshape(out_f, nb, 18)[:, :, 2:]
        codes = np.concatenate([blocks & 15, blocks >> 4], axis=2).reshape(out_f, in_f)
        scale = np.repeat(self.absmax, in_f // self.absmax.shape[1], axis=1)
        return torch.from_numpy(self.codebook[codes] * scale)


def check_linear(prefix: str, parts: dict[str, torch.Tensor], cfg: BnbConfig, in_f: int, out_f: int,
                 file: str) -> Bnb4Tensor | torch.Tensor:
    """One linear's tensors, validated: as kernel blocks, or (with the reason logged) its fp32
    weight [out, in] when blocks cannot hold it. A linear bitsandbytes left unquantized
    (``llm_int8_skip_modules``) is its float weight alone."""
    w = parts.get("weight")
    if len(parts) == 1 and w is not None and w.is_floating_point() and tuple(w.shape) == (out_f, in_f):
        return w.float()
    missing = [f"{prefix}.{k}" for k in ("weight", "weight.absmax", "weight.quant_map",
                                         f"weight.quant_state.bitsandbytes__{cfg.quant_type}") if k not in parts]
    if missing:
        raise ValueError(f"{file}: the bitsandbytes linear {prefix} lacks {', '.join(missing)}; the checkpoint is "
                         "incomplete (or its quant_type is not the config's)")
    state = _state(prefix, parts, cfg, file)
    bs = state.get("blocksize")
    if list(state.get("shape") or []) != [out_f, in_f]:
        raise ValueError(f"{file}: {prefix}.weight.quant_state has shape {state.get('shape')}, expected "
                         f"{[out_f, in_f]} from config.json")
    if not isinstance(bs, int) or bs <= 0 or bs % 2:
        raise ValueError(f"{file}: {prefix}.weight.quant_state has blocksize {bs!r}; expected a positive even number")
    w = parts["weight"]
    if w.dtype != torch.uint8 or w.numel() * 2 != out_f * in_f:
        raise ValueError(f"{file}: {prefix}.weight is {w.dtype} with {w.numel()} elements; a bitsandbytes 4-bit "
                         f"[{out_f} x {in_f}] weight is uint8 with {out_f * in_f // 2}")
    codebook = parts["weight.quant_map"].float().numpy().reshape(-1)
    if codebook.size != 16:
        raise ValueError(f"{file}: {prefix}.weight.quant_map has {codebook.size} values, not 16")
    absmax = _absmax(prefix, parts, state, -(-out_f * in_f // bs), file)
    if not np.isfinite(absmax).all():
        raise ValueError(f"{file}: {prefix}.weight.absmax has values that are not finite; the checkpoint is damaged")
    packed = w.numpy().reshape(-1)
    why = _blocks_reason(cfg, codebook, absmax, bs, in_f)
    if why is None:
        absmax = absmax.reshape(out_f, in_f // bs)
        codes = np.empty((out_f, in_f), dtype=np.uint8)
        b = packed.reshape(out_f, in_f // 2)
        codes[:, 0::2], codes[:, 1::2] = b >> 4, b & 15
        rows = block_rows(codes, absmax / np.float32(KERNEL_SCALE[cfg.quant_type]), bs)
        if rows is not None:
            return Bnb4Tensor(rows, KERNEL_TYPES[cfg.quant_type], (out_f, in_f), prefix, absmax, codebook)
        why = "a block scale is beyond fp16's range"
    logger.info("%s: bitsandbytes weight dequantized to fp32 (%s)", prefix, why)
    codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)
    return torch.from_numpy(codebook[codes] * np.repeat(absmax, bs)[: codes.size]).reshape(out_f, in_f)


def _absmax(prefix: str, parts: dict[str, torch.Tensor], state: dict[str, Any], blocks: int,
            file: str) -> np.ndarray:
    """fp32 [blocks]: as stored, or decoded from the nested form."""
    a = parts["weight.absmax"]
    if a.numel() != blocks:
        raise ValueError(f"{file}: {prefix}.weight.absmax has {a.numel()} values, expected {blocks}")
    if "nested_blocksize" not in state:
        if a.dtype != torch.float32:
            raise ValueError(f"{file}: {prefix}.weight.absmax is {a.dtype}; without nesting it is fp32")
        return a.numpy().reshape(-1)
    nbs, offset = state.get("nested_blocksize"), state.get("nested_offset")
    if "weight.nested_absmax" not in parts or "weight.nested_quant_map" not in parts:
        raise ValueError(f"{file}: {prefix}.weight.quant_state is nested but the checkpoint lacks "
                         f"{prefix}.weight.nested_absmax / nested_quant_map")
    if a.dtype != torch.uint8 or not isinstance(nbs, int) or nbs <= 0 or not isinstance(offset, (int, float)):
        raise ValueError(f"{file}: {prefix}.weight.absmax is {a.dtype} with nested_blocksize {nbs!r}; nested "
                         "absmax is uint8 with a positive nested_blocksize and a nested_offset")
    scale = parts["weight.nested_absmax"].float().numpy().reshape(-1)
    table = parts["weight.nested_quant_map"].float().numpy().reshape(-1)
    if table.size != 256 or scale.size != -(-blocks // nbs):
        raise ValueError(f"{file}: {prefix}.weight.nested_quant_map/nested_absmax have {table.size}/{scale.size} "
                         f"values, expected 256/{-(-blocks // nbs)}")
    return table[a.numpy().reshape(-1)] * np.repeat(scale, nbs)[:blocks] + np.float32(offset)


def _blocks_reason(cfg: BnbConfig, codebook: np.ndarray, absmax: np.ndarray, bs: int, in_f: int) -> str | None:
    if bs % 32 or in_f % bs:
        return f"blocks of {bs} weights do not tile rows of {in_f} in whole 32-weight blocks"
    if not np.allclose(codebook, CODEBOOKS[cfg.quant_type], rtol=0, atol=1e-6):
        return f"its quant_map is not bitsandbytes' {cfg.quant_type.upper()} codebook"
    return None


def block_rows(codes: np.ndarray, scale: np.ndarray, bs: int) -> np.ndarray | None:
    """uint8 [out, in / 32 * 18] NF4/FP4 kernel rows from codes uint8 [out, in] and the scale d
    per block [out, in / bs], or None when a scale does not fit fp16: when its rounding moves
    it by over 2^-10 of the tensor's largest scale (overflow; tiny scales may go subnormal,
    which moves their weights by far less than the tensor's quantization steps)."""
    out_f, in_f = codes.shape
    nb = in_f // 32
    d = np.repeat(scale, bs // 32, axis=1)
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
        if (np.abs(d16.astype(np.float32) - d) > float(np.abs(d).max(initial=0.0)) * 2.0**-10).any():
            return None
    halves = codes.reshape(out_f, nb, 2, 16)
    rows = np.empty((out_f, nb, 18), dtype=np.uint8)
    rows[:, :, :2] = d16.view(np.uint8).reshape(out_f, nb, 2)
    rows[:, :, 2:] = halves[:, :, 0] | (halves[:, :, 1] << 4)
    return rows.reshape(out_f, nb * 18)


def pack_linear(prefix: str, codes: torch.Tensor, absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one NF4 linear: codes uint8 [out, in] (0..15), absmax fp32
    [out * in / 64], as transformers writes them."""
    out_f, in_f = codes.shape
    flat = codes.reshape(-1, 2).to(torch.uint8)
    state = {"quant_type": "nf4", "blocksize": BLOCKSIZE, "dtype": "float32", "shape": [out_f, in_f]}
    return {f"{prefix}.weight": (flat[:, 0] << 4 | flat[:, 1]).reshape(-1, 1).contiguous(),
            f"{prefix}.weight.absmax": absmax.float().reshape(-1).contiguous(),
            f"{prefix}.weight.quant_map": torch.from_numpy(CODEBOOKS["nf4"].copy()),
            f"{prefix}.weight.quant_state.bitsandbytes__nf4": torch.frombuffer(
                bytearray(json.dumps(state).encode()), dtype=torch.uint8).clone()}


def _state(prefix: str, parts: dict[str, torch.Tensor], cfg: BnbConfig, file: str) -> dict[str, Any]:
    raw = parts[f"weight.quant_state.bitsandbytes__{cfg.quant_type}"]
    try:
        state = json.loads(raw.to(torch.uint8).numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: {prefix}.weight.quant_state is not bitsandbytes' JSON ({e}); the checkpoint "
                         "is damaged") from None
    if not isinstance(state, dict) or state.get("quant_type") != cfg.quant_type:
        got = state.get("quant_type") if isinstance(state, dict) else state
        raise ValueError(f"{file}: {prefix}.weight.quant_state says quant_type={got!r}, the config "
                         f"{cfg.quant_type!r}")
    return state
