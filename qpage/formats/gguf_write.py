"""GGUF files for llama.cpp: the metadata (model shape, tokenizer, chat template) and the
tensors under llama.cpp's names, with each tensor's block type chosen by the file type.

File types are llama.cpp's (``llama-quantize``'s names and ``general.file_type`` ids), and
so is the choice of type per tensor (``tensor_type``): the output matrix (or the tied
embedding) one step up, in Q6_K, and in the ``_M`` mixes the value and down projections of
the first and last eighth of the layers and every third layer between, since those measure
as the most sensitive. K-quants need rows of whole 256-weight super-blocks; a narrower tensor
falls back to the 32-weight type of the nearest size, as llama.cpp does, so files made here
and by ``llama-quantize`` hold the same types and compare bit for bit in size.

The file is streamed (``GgufStream``): the header and tensor table first (each tensor's type
and size are known from the source's shapes), then each tensor as it is quantized, so one
tensor is in memory at a time. It is written beside its destination and renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (int(t) for t in (_T.F32, _T.F16, _T.Q4_0, _T.Q4_1, _T.Q5_0,
                                                                        _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K))
FILE_TYPES = {"f32": (F32, 0), "f16": (F16, 1), "q4_0": (Q4_0, 2), "q4_1": (Q4_1, 3), "q8_0": (Q8_0, 7),
              "q5_0": (Q5_0, 8), "q5_1": (Q5_1, 9),
              "q4_k_s": (Q4_K, 14), "q4_k_m": (Q4_K, 15), "q5_k_s": (Q5_K, 16), "q5_k_m": (Q5_K, 17),
              "q6_k": (Q6_K, 18)}
"""File type name -> (the type of most linears, llama.cpp's ``general.file_type`` id)."""
FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
"""K-quant -> the 32-weight type used for rows that are not whole 256-weight super-blocks."""
QUANTIZATION_VERSION = 2


def _more_bits(i: int, n: int) -> bool:
    """The layers the ``_M`` mixes give more bits: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], file_type: str, n_layers: int, tied: bool) -> int:
    """The ggml type of tensor ``name`` (llama.cpp's name, shape [out, in]) in a file of ``file_type``."""
    base = FILE_TYPES[file_type][0]
    if len(shape) != 2:
        return F32  # norms and biases
    if base in (F32, F16):
        return base
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else -1
    kind = parts[2] if layer >= 0 else parts[0]
    t = base
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = Q8_0 if base == Q8_0 else Q6_K
    elif kind in ("attn_v", "ffn_down"):
        if file_type in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            t = Q6_K
        elif file_type == "q4_k_s" and layer < (4 if kind == "attn_v" else n_layers // 8):
            t = Q5_K
    if t in FALLBACK and shape[1] % 256:
        t = FALLBACK[t]
    return t


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    count = int(np.prod(shape))
    return count // block * nbytes


Metadata = list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]
"""(key, value, type, element type of an array) in file order."""


def metadata_from_gguf(path: Path, file_type: str) -> tuple[str, Metadata]:
    """(architecture, every key of an existing GGUF but its file type), for requantizing it."""
    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    out: Metadata = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version", "general.alignment"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        out.append((key, field.contents(), field.types[0], sub))
    out += _file_keys(file_type)
    return arch, out


def _file_keys(file_type: str) -> Metadata:
    return [("general.file_type", FILE_TYPES[file_type][1], GGUFValueType.UINT32, None),
            ("general.quantization_version", QUANTIZATION_VERSION, GGUFValueType.UINT32, None)]


def metadata_from_hf(folder: Path, config: dict[str, Any], file_type: str) -> tuple[str, Metadata]:
    """(architecture, keys) of a Hugging Face Llama-family folder: its shape from config.json,
    its tokenizer from tokenizer.json (byte-level BPE) and tokenizer_config.json."""
    if config.get("architectures", [""])[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"{folder}: writing GGUF from a Hugging Face folder is supported for the Llama family "
                         f"(Llama, Mistral, SmolLM), not {config.get('architectures')}")
    if config.get("rope_scaling"):
        raise ValueError(f"{folder}: rotary scaling {config['rope_scaling'].get('rope_type')!r} is not written to "
                         "GGUF by qpage; convert with llama.cpp's convert_hf_to_gguf.py and requantize that file")
    c = config
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    keys: Metadata = [
        ("general.name", folder.name, GGUFValueType.STRING, None),
        ("llama.block_count", int(c["num_hidden_layers"]), u32, None),
        ("llama.context_length", int(c.get("max_position_embeddings", 4096)), u32, None),
        ("llama.embedding_length", int(c["hidden_size"]), u32, None),
        ("llama.feed_forward_length", int(c["intermediate_size"]), u32, None),
        ("llama.attention.head_count", heads, u32, None),
        ("llama.attention.head_count_kv", int(c.get("num_key_value_heads", heads)), u32, None),
        ("llama.rope.freq_base", float(c.get("rope_theta", 10000.0)), f32, None),
        ("llama.attention.layer_norm_rms_epsilon", float(c.get("rms_norm_eps", 1e-6)), f32, None),
        ("llama.vocab_size", int(c["vocab_size"]), u32, None),
        ("llama.rope.dimension_count", head_dim, u32, None),
    ]
    if head_dim != c["hidden_size"] // heads:
        keys += [("llama.attention.key_length", head_dim, u32, None),
                 ("llama.attention.value_length", head_dim, u32, None)]
    return "llama", keys + tokenizer_keys(folder, int(c["vocab_size"])) + _file_keys(file_type)


_PRE_TOKENIZERS = {
    "gpt-2": [{"type": "ByteLevel", "use_regex": True}],
    "smollm": [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}],
    "llama-bpe": [{"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                                         "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                                                         "\\s+(?!\\S)|\\s+"}},
                  {"type": "ByteLevel", "use_regex": False}],
}
"""llama.cpp's pre-tokenizer names for the byte-level BPE splitters written here (only the
fields that decide the split are compared)."""


def _pre_tokenizer(tok: dict[str, Any], path: Path) -> str:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for name, want in _PRE_TOKENIZERS.items():
        if len(steps) == len(want) and all(all(s.get(k) == v for k, v in w.items())
                                           for s, w in zip(steps, want, strict=True)):
            return name
    raise ValueError(f"{path}: its pre-tokenizer ({json.dumps(pre)[:120]}...) is not one qpage maps to llama.cpp's "
                     f"({', '.join(_PRE_TOKENIZERS)}); convert with llama.cpp's convert_hf_to_gguf.py and "
                     "requantize that GGUF with qpage quantize --format gguf")


def tokenizer_keys(folder: Path, vocab_size: int) -> Metadata:
    """The ``tokenizer.*`` keys of a byte-level BPE tokenizer.json (GPT-2, SmolLM, Llama 3)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; GGUF files carry their tokenizer")
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE" or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path}: only byte-level BPE tokenizers are written to GGUF here (this one is "
                         f"{model.get('type')}); convert with llama.cpp's convert_hf_to_gguf.py and requantize that")
    vocab: dict[str, int] = dict(model["vocab"])
    types = {}
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        types[t["id"]] = 3 if t.get("special") else 4  # control, user-defined
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    token_type = [1] * n  # normal
    for s, i in vocab.items():
        tokens[i] = s
    for i in range(n):
        if tokens[i].startswith("[PAD") and tokens[i] not in vocab:
            token_type[i] = 5  # unused
    for i, kind in types.items():
        token_type[i] = kind
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    arr, s, u32 = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32
    keys: Metadata = [("tokenizer.ggml.model", "gpt2", s, None),
                      ("tokenizer.ggml.pre", _pre_tokenizer(tok, path), s, None),
                      ("tokenizer.ggml.tokens", tokens, arr, s),
                      ("tokenizer.ggml.token_type", token_type, arr, GGUFValueType.INT32),
                      ("tokenizer.ggml.merges", merges, arr, s)]
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        value = cfg.get(field)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value in vocab:
            keys.append((f"tokenizer.ggml.{key}_token_id", vocab[value], u32, None))
    keys.append(("tokenizer.ggml.add_bos_token", bool(cfg.get("add_bos_token", False)), GGUFValueType.BOOL, None))
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, str):
        keys.append(("tokenizer.chat_template", template, s, None))
    return keys


class GgufStream:
    """One GGUF file written in order: ``GgufStream(dest, arch, metadata, table)`` with the
    table's (name, shape [out, in], ggml type) in file order, then ``write(array)`` once per
    entry (values for F32, uint8 rows of blocks otherwise), then ``finish()``, which renames
    the file into place; ``abort()`` removes it."""

    def __init__(self, dest: Path, arch: str, metadata: Metadata, table: list[tuple[str, tuple[int, ...], int]]
                 ) -> None:
        self.dest = dest
        self.tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        self.table = list(table)
        self._next = 0
        self._w = GGUFWriter(None, arch)
        for key, value, vtype, sub in metadata:
            self._w.add_key_value(key, value, vtype, sub_type=sub)
        for name, shape, t in self.table:
            if t in (F32, F16):
                dtype = np.dtype(np.float32 if t == F32 else np.float16)
                self._w.add_tensor_info(name, shape, dtype, dtype.itemsize * int(np.prod(shape)))
            else:
                self._w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(shape, t),
                                        raw_dtype=GGMLQuantizationType(t))
        self._w.write_header_to_file(self.tmp)
        self._w.write_kv_data_to_file()
        self._w.write_ti_data_to_file()

    def pending(self) -> Iterator[tuple[str, tuple[int, ...], int]]:
        return iter(self.table[self._next :])

    def write(self, data: np.ndarray) -> None:
        name, shape, t = self.table[self._next]
        want = tensor_nbytes(shape, t)
        if data.nbytes != want:
            raise ValueError(f"{name}: {data.nbytes} bytes for a {shape} tensor of type {t} (expected {want})")
        self._w.write_tensor_data(np.ascontiguousarray(data))
        self._next += 1

    def finish(self) -> None:
        if self._next != len(self.table):
            raise ValueError(f"{len(self.table) - self._next} tensors were not written")
        self._w.close()
        os.replace(self.tmp, self.dest)

    def abort(self) -> None:
        try:
            self._w.close()
        finally:
            self.tmp.unlink(missing_ok=True)
