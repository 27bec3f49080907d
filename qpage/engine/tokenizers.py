"""A model's tokenizer and end-of-sequence ids, from a GGUF file's metadata or a Hugging Face
folder (never remote code), and the check that two models share one vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qpage.formats import gguf_model
from qpage.formats.gguf_model import is_gguf
from qpage.formats.gguf_reader import GgufFile


def load_tokenizer(model_dir: Path) -> Any:
    if is_gguf(model_dir):
        return gguf_model.load_tokenizer(GgufFile(model_dir))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:
        raise ValueError(
            f"{model_dir}: could not load the tokenizer ({e}); the folder needs tokenizer.json "
            "or tokenizer.model with tokenizer_config.json"
        ) from e


def eos_token_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if is_gguf(model_dir):
        ids.update(gguf_model.eos_token_ids(GgufFile(model_dir)))
    elif gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def check_same_vocabulary(draft: Any, target: Any, name: str) -> None:
    """Raise ValueError unless the two tokenizers map the same strings to the same ids."""
    if draft.get_vocab() != target.get_vocab():
        raise ValueError(f"speculative_config model={name!r}: its tokenizer differs from the target's; a draft "
                         "model must share the target's vocabulary")
