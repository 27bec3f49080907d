"""GGUF files run natively: the reader against the ``gguf`` package, the default model's
weights kept in their blocks, its logits against transformers on the same weights
dequantized, and bad files refused with the tensor or key named.

Tolerance of the logits: the block-format kernels quantize activations to int8 blocks, as
llama.cpp does, so they are not equal to an fp32 run; on a 256-token wikitext window the
mean KL to transformers measured 0.0027 nats and the top-1 agreement 96.5%. The test holds
them to a mean KL below 0.01 and an agreement of at least 90%; a wrong q/k row order or a
misread block gives KLs of several nats.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qpage import LLM
from qpage.config import cache_root
from qpage.formats.gguf import default_gguf_path
from qpage.formats.gguf_reader import GgufFile, GgufFormatError
from tests.helpers import RunnerHarness

gguf = pytest.importorskip("gguf")
DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext2" / "test.txt"


def window_ids(tokenizer: Any, n: int = 256) -> list[int]:
    if DATA.is_file():
        text = DATA.read_text()[:4000]
    else:  # pragma: no cover - the data folder sits beside the repository on project machines
        text = " ".join(f"The {i}th record of the archive describes a town by the river." for i in range(60))
    return tokenizer.encode(text)[:n]


def test_reader_matches_the_gguf_package() -> None:
    path = default_gguf_path()
    ours, ref = GgufFile(path, string_arrays=True), gguf.GGUFReader(str(path))
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.nbytes == int(t.n_bytes), t.name
        assert mine.shape == tuple(int(x) for x in reversed(t.shape)), t.name
        assert ours.data(t.name).tobytes() == np.asarray(t.data).tobytes(), t.name
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()) if isinstance(
                field.contents(), float) else ours.metadata[key] == field.contents(), key


@pytest.fixture(scope="module")
def native() -> RunnerHarness:
    before = set((cache_root() / "models").glob("*")) if (cache_root() / "models").is_dir() else set()
    h = RunnerHarness(default_gguf_path(), num_blocks=32, max_len=512)
    after = set((cache_root() / "models").glob("*")) if (cache_root() / "models").is_dir() else set()
    assert after == before, "loading a GGUF wrote a model folder"
    return h


def test_default_model_stays_in_its_blocks(native: RunnerHarness) -> None:
    f = GgufFile(default_gguf_path())
    quantized = sum(t.nbytes for t in f.tensors.values() if t.type_name != "F32")
    mods = [m for m in native.model.modules() if hasattr(m, "kernel_path")]
    assert {m.kernel_path for m in mods} == {"cpu-blocks"} and len(mods) == 4 * 30 + 1  # linears + the embedding
    held = sum(m.weight_bytes for m in mods)
    assert quantized <= held <= 1.05 * quantized  # rows padded to groups of 16 at most


def test_logits_match_transformers_on_the_dequantized_weights(native: RunnerHarness, hf_model: Any,
                                                              tokenizer: Any) -> None:
    ids = window_ids(tokenizer)
    ours = native.step([(native.request("r", ids), len(ids))])["r"].double()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].double()
    p_ref, p_ours = F.log_softmax(ref, -1), F.log_softmax(ours, -1)
    kl = (p_ref.exp() * (p_ref - p_ours)).sum(-1)
    assert kl.mean() < 0.01, float(kl.mean())
    assert (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.9


# ---------------------------------------------------------------- bad files

LLAMA_KEYS = {"llama.block_count": 1, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
              "llama.attention.head_count": 2, "llama.context_length": 256}


def write_gguf(path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in keys.items():
        if isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    src = default_gguf_path().read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src[: len(src) // 2])
    with pytest.raises(GgufFormatError, match=r"tensor '.+' ends at byte \d+ but the file has \d+: the file is "
                                              r"truncated"):
        LLM(model=str(bad))
    (tmp_path / "header.gguf").write_bytes(src[:1000])
    with pytest.raises(GgufFormatError, match="truncated or corrupt GGUF header"):
        GgufFile(tmp_path / "header.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GgufFormatError, match="not a GGUF file"):
        LLM(model=str(tmp_path / "x.gguf"))


def test_unknown_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", "llama", LLAMA_KEYS, {"token_embd.weight": np.zeros((4, 64), np.float32)})
    raw = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8  # after the name: dims (uint32), two sizes (uint64)
    assert struct.unpack_from("<I", raw, at)[0] == 0  # F32
    struct.pack_into("<I", raw, at, 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(GgufFormatError, match=r"tensor 'token_embd\.weight' has ggml type 99"):
        GgufFile(path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "g.gguf", "mamba", {"mamba.block_count": 1})
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        LLM(model=str(path))


def test_missing_keys_and_tokenizer_are_named(tmp_path: Path) -> None:
    keys = dict(LLAMA_KEYS)
    del keys["llama.feed_forward_length"]
    with pytest.raises(GgufFormatError, match=r"'llama\.feed_forward_length' is missing"):
        LLM(model=str(write_gguf(tmp_path / "k.gguf", "llama", keys)))
    with pytest.raises(GgufFormatError, match=r"cannot build the tokenizer .* tokenizer\.ggml"):
        LLM(model=str(write_gguf(tmp_path / "t.gguf", "llama", LLAMA_KEYS)))
