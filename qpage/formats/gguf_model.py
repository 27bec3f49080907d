"""A GGUF file as a qpage model: its config (from llama.cpp's metadata keys), its tokenizer and
chat template (built by transformers from the metadata), and its tensors under Hugging Face
names, quantized ones still in their blocks (``GgufTensor``).

llama.cpp stores a Llama's q and k projections with each head's rows interleaved for its
rotary layout; they are put back in Hugging Face order here, on whole rows, which for block
formats are whole runs of blocks, so packed data moves without being decoded. Qwen files
are stored in Hugging Face order already.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from qpage.config import cache_root
from qpage.formats.gguf_moe import EXPERT_TENSORS, MOE_ARCHITECTURES, MOE_LAYER_NAMES, expert_names, is_moe, moe_config
from qpage.formats.gguf_reader import BF16, F16, F32, GgufFile, GgufFormatError, TensorInfo
from qpage.formats.gguf_rope import longrope, yarn

logger = logging.getLogger("qpage")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 **MOE_ARCHITECTURES}
"""GGUF ``general.architecture`` -> the Hugging Face class qpage runs it as (Mistral files say "llama")."""
PERMUTED = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter interleaves."""
NORM_PLUS_ONE = ("gemma2", "gemma3")
"""Architectures whose norm weights llama.cpp's converter stores as ``1 + w`` (Gemma's norms
scale by it); the reader gives back ``w``, the checkpoint's value."""
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
"""Every n-th layer is global (the rest local) when the file does not say: llama.cpp's default."""
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The 27B models scale attention by (hidden / heads)^-1/2 rather than head_dim^-1/2; llama.cpp
knows them by their layer count."""

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
}
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
                     "gpt-oss": {"post_attention_norm": "post_attention_layernorm"}}
"""Per architecture, tensors whose name means something else there (phi3's ffn_up holds gate
then up, as Phi-3's gate_up_proj; Gemma's ffn_norm is the norm before the MLP, with norms
after attention and MLP besides)."""
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
"""Tensors that are read as configuration (``hf_config``), not weights."""


@dataclass(frozen=True)
class GgufConfig:
    """The ``quantization_config`` of a GGUF model: each tensor carries its own format."""

    quant_method: str = "gguf"

    def wants(self, parts: dict[str, Any]) -> bool:
        """Whether one linear's tensors are all there: its weight alone."""
        return "weight" in parts

    def linear_part(self, prefix: str, parts: dict[str, Any], in_f: int, out_f: int, file: str) -> Any:
        """The linear's weight as loaded: a ``GgufTensor``, or fp32 for float tensors."""
        return parts["weight"]


@dataclass
class GgufTensor:
    """A quantized tensor as stored: ``rows`` uint8 [out_features, bytes per row] (a view of
    the file or a reordered copy), its ggml type, and its shape [out_features, in_features]."""

    rows: np.ndarray
    ggml_type: int
    shape: tuple[int, int]
    name: str
    """The GGUF tensor name (for errors)."""

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] through the ``gguf`` package (the reference dequantization)."""
        return torch.from_numpy(np.ascontiguousarray(dequantize(self.rows, self.ggml_type), dtype=np.float32))

    def block(self) -> tuple[int, int]:
        """(weights, bytes) of one block of a row."""
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]

    def take_rows(self, a: int, b: int) -> GgufTensor:
        """Output rows [a, b) (a view)."""
        return dataclasses.replace(self, rows=self.rows[a:b], shape=(b - a, self.shape[1]))

    def take_cols(self, a: int, b: int) -> GgufTensor:
        """Input columns [a, b) of every row (a view): whole blocks only."""
        size, nbytes = self.block()
        if a % size or b % size:
            raise ValueError(f"{self.name}: input columns [{a}, {b}) do not fall on the weight's {size}-weight "
                             "blocks; run it with tensor_parallel_size=1, or a file of 32-weight blocks "
                             "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)")
        return dataclasses.replace(self, rows=self.rows[:, a // size * nbytes : b // size * nbytes],
                                   shape=(self.shape[0], b - a))


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def hf_config(f: GgufFile) -> dict[str, Any]:
    """The file's model shape as a Hugging Face ``config.json`` dict (``models.arch`` parses it)."""
    arch = f.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufFormatError(f"{f.path}: architecture {arch!r} is not supported; qpage runs GGUF files of "
                              f"{', '.join(ARCHITECTURES)} (Llama 2/3, Mistral, SmolLM, Qwen2/2.5, Qwen3, Phi-3/4)")
    if "rope_freqs.weight" in f.tensors:
        raise GgufFormatError(f"{f.path}: rope_freqs.weight (Llama 3.1-style rotary frequency factors) is not "
                              "supported yet in GGUF files; run the model's safetensors checkpoint instead")
    scaling = f.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "yarn") and not (scaling == "linear" and arch in GEMMA_PATTERN):
        raise GgufFormatError(f"{f.path}: rotary scaling {scaling!r} is not supported yet in GGUF files")
    heads = _positive(f, f"{arch}.attention.head_count")
    hidden = _positive(f, f"{arch}.embedding_length")
    head_dim = int(f.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = f.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise GgufFormatError(f"{f.path}: rotary embedding on {rotary} of each head's {head_dim} dimensions (partial "
                              "rotary, as in Phi-4-mini) is not supported yet; qpage rotates whole heads")
    vocab = f.get(f"{arch}.vocab_size") or len(f.get("tokenizer.ggml.tokens") or [])
    if not vocab and "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(f.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(f.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(f"{arch}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors and arch != "qwen2",
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "gguf"},
    }
    if "rope_factors_long.weight" in f.tensors:
        cfg["rope_parameters"] = longrope(f, arch, cfg["rope_theta"])
    if scaling == "yarn":
        cfg["rope_parameters"] = yarn(f, arch, cfg["rope_theta"])
    window = f.get(f"{arch}.attention.sliding_window")
    if is_moe(f, arch):
        cfg.update(moe_config(f, arch, cfg["num_hidden_layers"]))
    if arch in GEMMA_PATTERN:
        cfg.update(_gemma(f, arch, cfg))
    elif window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True
    return cfg


def _gemma(f: GgufFile, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's config fields from a file, read as llama.cpp reads them: its local layers
    from ``attention.sliding_window_pattern`` (every n-th layer global, or one flag per
    layer), Gemma 3's local rope base from ``rope.freq_base_swa`` (10000 when absent), the
    global layers' linear rope scaling, soft caps, and the attention scale (by layer count)."""
    layers = cfg["num_hidden_layers"]
    window = f.get(f"{arch}.attention.sliding_window") or (4096 if arch == "gemma2" else None)
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GgufFormatError(f"{f.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                                  f"{layers} layers")
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "attn_logit_softcapping": f.get(f"{arch}.attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
        "final_logit_softcapping": f.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        "query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"]
                                  if layers == GEMMA_27B_LAYERS[arch] else cfg["head_dim"]),
        "tie_word_embeddings": arch == "gemma2" or "output.weight" not in f.tensors,
    }
    if arch == "gemma2":
        if f.get(f"{arch}.rope.scaling.type") == "linear" or f.get(f"{arch}.rope.freq_base_swa") is not None:
            raise GgufFormatError(f"{f.path}: rotary scaling or a local rope base on a Gemma 2 file is not supported")
        return out
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if f.get(f"{arch}.rope.scaling.type") == "linear":
        full = {"rope_type": "linear", "rope_theta": cfg["rope_theta"],
                "factor": float(f.require(f"{arch}.rope.scaling.factor"))}
    local = {"rope_type": "default", "rope_theta": float(f.get(f"{arch}.rope.freq_base_swa", 10000.0))}
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


def _positive(f: GgufFile, key: str) -> int:
    v = f.require(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise GgufFormatError(f"{f.path}: metadata {key} is {v!r}; expected a positive integer")
    return v


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleave of each head's rotary halves: its row (head, j, i) holds
    Hugging Face row (head, i, j), i < 2, j < head_dim / 2 (rows stay whole)."""
    n = rows.shape[0]
    return rows[np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)]


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch``, None for tensors qpage
    does not use as weights."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    if name in _IGNORED:
        return None
    parts = name.split(".")
    names = {**_LAYER_NAMES, **MOE_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise GgufFormatError(f"tensor {name!r} is not part of a model qpage runs")


_GGUF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_GGUF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}


def gguf_name(name: str) -> str:
    """The GGUF tensor name of a Hugging Face one (``hf_name``'s inverse)."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        module, _, suffix = parts[3].rpartition(".")
        if module in _GGUF_LAYER_NAMES:
            return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES[module]}.{suffix}"
    raise ValueError(f"tensor {name!r} has no GGUF name (qpage writes the Llama family's tensors)")


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face q/k rows in llama.cpp's rotary order (``_unpermute``'s inverse)."""
    n = rows.shape[0]
    return rows[np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)]


def iter_tensors(f: GgufFile) -> Iterator[tuple[str, str, torch.Tensor | GgufTensor]]:
    """(file name, Hugging Face name, value): float tensors as fp32 torch tensors, block formats
    as ``GgufTensor``; q/k rows in Hugging Face order."""
    arch = f.require("general.architecture")
    heads = _positive(f, f"{arch}.attention.head_count")
    kv_heads = f.get(f"{arch}.attention.head_count_kv", heads)
    for name, info in f.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[2] in EXPERT_TENSORS:
            yield from _experts(f, info, parts[1], parts[2], parts[3])
            continue
        target = hf_name(name, arch)
        if target is None:
            continue
        value = tensor_value(f, info)
        if arch in NORM_PLUS_ONE and name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = value - 1.0
        if name.endswith("ffn_gate_inp_shexp.weight") and isinstance(value, torch.Tensor):
            value = value.reshape(1, -1)  # stored [hidden]; a linear to one output
        if target is not None and target.endswith("self_attn.sinks.weight"):
            target = target.removesuffix(".weight")  # a parameter of the attention, not a linear's
        if arch in PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            h = heads if ".attn_q." in name else kv_heads
            if not isinstance(h, int) or h <= 0 or info.shape[0] % (2 * h):
                raise GgufFormatError(f"{f.path}: tensor {name!r} has {info.shape[0]} rows, not a whole number of "
                                      f"rotary head pairs for {h} heads; the file and its metadata disagree")
            value = _permuted(value, h)
        yield f.path.name, target, value


def _experts(f: GgufFile, info: TensorInfo, layer: str, kind: str, suffix: str
             ) -> Iterator[tuple[str, str, torch.Tensor | GgufTensor]]:
    """A 3-d expert tensor [experts, rows, cols] as one 2-d weight per expert (views); a bias
    [experts, rows] as one row each."""
    if suffix == "bias" and len(info.shape) == 2 and info.ggml_type in (F32, F16, BF16):
        biases = tensor_value(f, info)
        for e, name in enumerate(expert_names(layer, kind, info.shape[0], "bias")):
            yield f.path.name, name, biases[e]
        return
    if len(info.shape) != 3 or suffix != "weight":
        raise GgufFormatError(f"{f.path}: tensor {info.name!r} has shape {info.shape}; expected [experts, rows, cols]")
    experts, n, k = info.shape
    floats = tensor_value(f, info) if info.ggml_type in (F32, F16, BF16) else None
    data = f.data(info.name)
    for e, name in enumerate(expert_names(layer, kind, experts)):
        if isinstance(floats, torch.Tensor):
            value: torch.Tensor | GgufTensor = floats[e]
        else:
            value = GgufTensor(data[e * n : (e + 1) * n], info.ggml_type, (n, k), f"{info.name}[{e}]")
        yield f.path.name, name, value


def tensor_value(f: GgufFile, info: TensorInfo) -> torch.Tensor | GgufTensor:
    """One tensor as stored: float types (BF16 included) as fp32, block formats as ``GgufTensor``."""
    data = f.data(info.name)
    if info.ggml_type in (F32, F16):
        return torch.from_numpy(data.astype(np.float32))
    if info.ggml_type == BF16:
        bits = data.reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(info.shape))
    if len(info.shape) != 2:
        raise GgufFormatError(f"{f.path}: tensor {info.name!r} is a {len(info.shape)}-d {info.type_name} tensor; "
                              "qpage reads quantized tensors as 2-d weights only")
    return GgufTensor(data, info.ggml_type, (info.shape[0], info.shape[1]), info.name)


def _permuted(value: torch.Tensor | GgufTensor, heads: int) -> torch.Tensor | GgufTensor:
    if isinstance(value, GgufTensor):
        return GgufTensor(_unpermute(value.rows, heads), value.ggml_type, value.shape, value.name)
    flat = value.reshape(value.shape[0], -1).numpy()
    return torch.from_numpy(_unpermute(flat, heads).reshape(value.shape))


def load_tokenizer(f: GgufFile) -> Any:
    """The tokenizer and chat template the metadata describes, built by transformers; the
    built tokenizer is cached under ``$QPAGE_CACHE/tokenizers`` (keyed by the file's path,
    size and modification time, written then renamed), since building it reads the whole
    vocabulary and takes about a second."""
    from transformers import PreTrainedTokenizerFast

    tok_file, config_file = _tokenizer_cache(f.path)
    try:
        config = json.loads(config_file.read_text())
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **config)
    except Exception as e:  # not cached yet, or unreadable (tokenizers raises plain Exception): build it
        logger.debug("building the tokenizer of %s (%s)", f.path, e)
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, tok, tok_config = get_gguf_tokenizer(str(f.path))
        backend, extra = convert_gguf_tokenizer(arch, tok)
    except (ImportError, KeyError, ValueError) as e:
        raise GgufFormatError(f"{f.path}: cannot build the tokenizer from the GGUF metadata ({e}); the file needs "
                              "tokenizer.ggml.model and tokenizer.ggml.tokens") from None
    config = {**tok_config, **extra}
    try:
        tok_file.parent.mkdir(parents=True, exist_ok=True)
        for dst, text in ((tok_file, backend.to_str()), (config_file, json.dumps(config))):  # config last: it marks
            tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")                           # the pair complete
            tmp.write_text(text)
            tmp.replace(dst)
    except (OSError, TypeError) as e:  # a read-only cache folder: build it again next time
        logger.debug("could not cache the tokenizer of %s: %s", f.path, e)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


def _tokenizer_cache(path: Path) -> tuple[Path, Path]:
    """(tokenizer.json, its transformers settings) for this file's built tokenizer."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    base = cache_root() / "tokenizers" / f"{path.stem}-{key}"
    return base.with_name(base.name + ".tokenizer.json"), base.with_name(base.name + ".config.json")


def eos_token_ids(f: GgufFile) -> set[int]:
    """The end-of-sequence ids the metadata names (end of text and end of turn)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(f.get(k)) for k in keys if f.get(k) is not None}
