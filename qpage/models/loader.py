"""Find a model (a folder or a .gguf file), read its config and build the model with its weights.

Weights are read from safetensors or GGUF only. Pickle ``.bin`` checkpoints can run arbitrary code
when loaded; they are refused unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qpage.config import cache_root
from qpage.formats.gguf import convert_gguf, default_gguf_path, default_model_dir
from qpage.formats.gguf_model import hf_config, is_gguf
from qpage.formats.gguf_model import iter_tensors as iter_gguf_tensors
from qpage.formats.gguf_reader import GgufFile
from qpage.formats.gguf_requant import requantized
from qpage.formats.safetensors_io import LazyTensor, lazy_tensors
from qpage.models.arch import ArchConfig, parse_arch_config
from qpage.models.registry import model_class
from qpage.models.sharding import WHOLE_MODEL, Rank

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model: str | None) -> Path:
    """The folder of ``model``, or its ``.gguf`` file (run natively); None means the default
    model's GGUF."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model folder "
            "(config.json + *.safetensors) or a .gguf file, or leave --model out for the default model"
        )
    if is_gguf(path):
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; pass a Hugging Face model folder (config.json, "
            "tokenizer files, *.safetensors) or a .gguf file"
        )
    return path


def resolve_hf_folder(model: str | None) -> Path:
    """A Hugging Face folder for ``model``: a GGUF (the default model's too) is converted to
    a float32 safetensors folder once; what the quantizers read."""
    path = resolve_model_dir(model)
    if not is_gguf(path):
        return path
    if model is None:
        return default_model_dir()
    out = cache_root() / "models" / f"{path.stem}-{path.stat().st_size:x}"
    return out if (out / "model.safetensors").is_file() else convert_gguf(path, out)


def read_arch_config(model_dir: Path) -> ArchConfig:
    if is_gguf(model_dir):
        return parse_arch_config(hf_config(GgufFile(model_dir)), str(model_dir))
    cfg_path = model_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}); restore the file") from None
    return parse_arch_config(cfg, str(cfg_path))


def resolve_dtype(name: str, arch: ArchConfig, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (bf16/fp16 matmuls are slower there at small batch and less
    exact) and the checkpoint's dtype on an accelerator."""
    if name != "auto":
        return DTYPE_NAMES[name]
    if device.type == "cpu":
        return torch.float32
    ck = DTYPE_NAMES.get(arch.torch_dtype, torch.float16)
    return torch.float16 if ck == torch.float32 else ck


def weight_files(model_dir: Path, allow_pickle: bool) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
    if pickles and not allow_pickle:
        raise ValueError(
            f"{model_dir} holds only pickle weights ({pickles[0].name}); pickle can run code when "
            "loaded, so qpage refuses it. Convert the checkpoint to safetensors, or pass "
            "allow_pickle=True (--allow-pickle) if you trust its source"
        )
    if pickles:
        return pickles
    raise FileNotFoundError(f"{model_dir} has no *.safetensors weight files")


def iter_tensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, str, torch.Tensor | LazyTensor]]:
    """(file name, tensor name, tensor) over the weight files; with ``lazy``, safetensors
    tensors are not read yet (a tensor-parallel rank reads only its slices)."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        if lazy and f.suffix == ".safetensors":
            for name, lazy_t in lazy_tensors(f):
                yield f.name, name, lazy_t
            continue
        if f.suffix != ".safetensors":
            state = torch.load(f, map_location="cpu", weights_only=True)
            for name, t in state.items():
                yield f.name, name, t
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield f.name, name, st.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e}); re-download it") from None


def load_model(
    model_dir: Path, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
    max_positions: int, allow_pickle: bool = False, dequantize_weights: bool = False,
    rank: Rank | None = None, requantize: str | None = None,
) -> torch.nn.Module:
    """The model with its weights, kernels chosen; with ``rank`` (a split model), this rank's
    part of it, its split layers wrapped in their collectives. ``requantize`` (a format of
    ``gguf_requant.REQUANT_TYPES``): every linear is requantized to that block format as it is
    read, from float or GGUF weights, the embedding and output head to ``gguf_requant.HEAD_FORMAT`` (a
    ``self:`` draft model)."""
    if requantize is not None:
        arch = dataclasses.replace(arch, quantization={"quant_method": "gguf"})
    cls = model_class(arch.architecture)
    with torch.device("cpu"):
        model = cls(arch if rank is None else rank.plan.local_arch(arch), max_positions, dtype)
    model.to(dtype)
    parts = WHOLE_MODEL if rank is None else rank
    if is_gguf(model_dir):
        tensors: Iterator[tuple[str, str, Any]] = iter_gguf_tensors(GgufFile(model_dir))
    else:
        tensors = iter_tensors(weight_files(model_dir, allow_pickle), lazy=rank is not None)
    if requantize is not None:
        tensors = requantized(tensors, set(model.quant_targets()), requantize, {"model.embed_tokens", "lm_head"})
    model.load_weights(tensors, parts)
    model.to_device(device)
    model.prepare(dequantize_weights)
    if rank is not None:
        rank.wrap(model)
    model.eval()
    return model
