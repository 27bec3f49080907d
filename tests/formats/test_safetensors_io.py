"""The low-memory safetensors reader/writer against the safetensors package, and bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qpage.formats.safetensors_io import iter_tensors, read_header, write_file


def test_roundtrip_with_the_safetensors_package(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int32),
               "c": torch.randn(4, generator=g).half(), "d": torch.randn(2, 3, generator=g).to(torch.bfloat16),
               "e": torch.randn(6, generator=g).to(torch.float8_e4m3fn), "f": torch.zeros(0)}
    write_file(tmp_path / "ours.safetensors", tensors)
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    ours = dict(iter_tensors(tmp_path / "theirs.safetensors"))
    for name, t in tensors.items():
        assert torch.equal(theirs[name].view(torch.uint8), t.view(torch.uint8)) and theirs[name].dtype == t.dtype
        assert torch.equal(ours[name].view(torch.uint8), t.view(torch.uint8)) and ours[name].shape == t.shape


def test_truncated_and_garbage_files(tmp_path: Path) -> None:
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="lies outside the file"):
        read_header(tmp_path / "t.safetensors")
    (tmp_path / "g.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"header length \d+ does not fit the file"):
        read_header(tmp_path / "g.safetensors")
