"""Validated configuration dataclasses: one per concern, each default written once.

The CLI reads its defaults off these classes (see ``qpage.cli``), so a default changed
here changes everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default; docs/kv-cache.md)."""


def cache_root() -> Path:
    """qpage's cache (converted models, built C kernels): $QPAGE_CACHE, else ~/.cache/qpage."""
    return Path(os.environ.get("QPAGE_CACHE", Path.home() / ".cache" / "qpage"))

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte count given as a number or a string such as ``"2GiB"`` or ``"512MB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a byte count; give e.g. 2147483648 or '2GiB'")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            raise ValueError(f"{what}={value!r} is not a byte count; give e.g. 2147483648 or '2GiB'")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    else:
        raise ValueError(f"{what}={value!r} is not a byte count; give e.g. 2147483648 or '2GiB'")
    if n <= 0:
        raise ValueError(f"{what}={value!r} must be positive")
    return n


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_FORMATS: dict[str, str | None] = {
    "auto": None, "fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "int8": "int8", "int4": "int4",
    "k8v4": "k8v4", "int8_per_token_head": "int8", "int4_per_token_head": "int4",
}
"""kv_cache_dtype -> the stored format (``layers.attention.kv_format``; None: the model dtype)."""
KV_CACHE_DTYPES = tuple(KV_CACHE_FORMATS)
INT_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4)}
"""Integer cache formats -> (K bits, V bits)."""
KV_CACHE_SCALES = ("per_token", "per_tensor")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""What ``logprobs`` report (vLLM's names): the model's own distribution, or the one greedy
decoding picks from (after penalties, min_tokens and structured-output masking)."""
ATTENTION_BACKENDS = ("auto", "triton", "cpu-native", "cpu-blas", "torch")


@dataclass
class ModelConfig:
    """Which model to run and how to load it."""

    model: str | None = None
    """Local Hugging Face model folder (safetensors); None runs the default model."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's limit, capped to the KV capacity."""
    allow_pickle: bool = False
    """Allow loading pickle ``.bin`` weights (unsafe: pickle runs code). Off by default."""
    trust_remote_code: bool = False
    """Never needed for the supported architectures; kept for vLLM compatibility, must stay False."""
    device: str = "cpu"
    """torch device to run on."""
    attention_backend: str = "auto"
    """Attention kernels: auto (Triton on CUDA; on CPU fp32 the C kernels, else BLAS; else torch), triton,
    cpu-native, cpu-blas, torch."""
    dequantize_weights: bool = False
    """Dequantize quantized weights once at load instead of keeping them packed (on CPU fp32 copies:
    about 7x the memory of 4-bit weights). For comparisons; the packed kernels are the default."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not supported; choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be at least 2")
        if self.trust_remote_code:
            raise ValueError(
                "trust_remote_code=True is not supported: qpage runs only its own model code "
                "for the supported architectures; drop the flag"
            )


@dataclass
class CacheConfig:
    """The paged KV cache."""

    kv_cache_memory: int | str = "1GiB"
    """KV cache budget in bytes or as a string ('2GiB'); decides how many tokens fit."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier requests that share a prompt prefix."""
    block_size: int = BLOCK_SIZE
    """Tokens per block."""
    kv_cache_dtype: str = "auto"
    """auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8 (~0.5x fp16 bytes), k8v4 (~0.4x) or int4 (~0.28x)."""
    kv_cache_scales: str = "per_token"
    """FP8 scales: per_token (per token and kv head, set at write) or per_tensor (checkpoint k/v_scale, else 1)."""
    kv_cache_rotation: bool = True
    """int8, int4 and k8v4 caches: Hadamard-rotate K and V before quantizing (off only to measure it)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales={self.kv_cache_scales!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_SCALES)}")
        integer = KV_CACHE_FORMATS[self.kv_cache_dtype] in INT_BITS
        if integer and self.kv_cache_scales != "per_token":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} always keeps parameters per token and kv head; "
                             f"kv_cache_scales={self.kv_cache_scales!r} applies to FP8 caches only: leave it out")
        if not integer and not self.kv_cache_rotation:
            raise ValueError(f"kv_cache_rotation=False applies to the int8, int4 and k8v4 caches only, not "
                             f"kv_cache_dtype={self.kv_cache_dtype!r}: leave it out")
        self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.block_size != BLOCK_SIZE:
            raise ValueError(f"block_size={self.block_size} is not supported; qpage uses {BLOCK_SIZE}")


@dataclass
class SchedulerConfig:
    """Continuous batching."""

    max_num_seqs: int = 64
    """Most requests running in one step."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step: decodes plus prefill chunks."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1"
            )


@dataclass
class ParallelConfig:
    """Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA)."""

    tensor_parallel_size: int = 1
    """Ranks that each hold 1/N of every layer and of the KV cache (worker processes, or torchrun's)."""
    distributed_timeout: float = 300.0
    """Seconds a rank may take inside a step before the engine stops with an error naming it (dead or hung)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout={self.distributed_timeout} must be a positive number of seconds")


SPECULATIVE_METHODS = ("ngram", "draft_model")
SELF_DRAFTS = ("int4", "q4_0", "q4_1", "q8_0")
"""Block formats a ``self:`` draft may take (int4 is Q4_0: 32-weight blocks, one scale each)."""


@dataclass
class SpeculativeConfig:
    """Speculative decoding, under vLLM's ``speculative_config`` names (docs/speculative.md)."""

    method: str | None = None
    """ngram: draft the tokens that followed the latest earlier occurrence of the context's last
    n tokens (prompt lookup), for n from prompt_lookup_max down to prompt_lookup_min.
    draft_model: a smaller model with the same tokenizer drafts greedily (the default when
    ``model`` is given)."""
    model: str | None = None
    """The draft model (draft_model): a GGUF file, a Hugging Face folder, or ``self:FORMAT``, the
    target itself requantized at load to a block format of ``SELF_DRAFTS``."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per request and step."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched (ngram; default 2, or prompt_lookup_max when only that is given)."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched (ngram; default 4, or prompt_lookup_min when only that is given)."""

    def __post_init__(self) -> None:
        if self.method == "[ngram]":  # vLLM's older spelling
            self.method = "ngram"
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not supported; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"speculative_config num_speculative_tokens={self.num_speculative_tokens!r} must be "
                             "an integer from 1 to 32")
        if self.method == "draft_model":
            self._check_draft_model()
            return
        if self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'; drop it, or drop the method "
                             "to draft with the model")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 2, 4
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ValueError(f"speculative_config prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be "
                             "integers with 1 <= min <= max <= 64")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model': a GGUF file, a Hugging Face "
                             f"folder, or self:FORMAT ({', '.join('self:' + f for f in SELF_DRAFTS)})")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max belong to method 'ngram'; drop them "
                             "for a draft model")
        if self.model.startswith("self:") and self.self_format not in SELF_DRAFTS:
            raise ValueError(f"speculative_config model={self.model!r}: a self draft takes one of "
                             f"{', '.join('self:' + f for f in SELF_DRAFTS)}")

    @property
    def self_format(self) -> str | None:
        """The block format of a ``self:`` draft (int4 read as q4_0); None for any other."""
        if self.model is None or not self.model.startswith("self:"):
            return None
        name = self.model[len("self:"):].lower()
        return "q4_0" if name == "int4" else name

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, as ``--speculative-config`` takes it); unknown keys
        are refused by name, so a misspelt option is never silently ignored."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): give e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything an engine needs, passed down as one object."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    """Seed of the sampler for requests that give none."""
    logprobs_mode: str = "raw_logprobs"
    """raw_logprobs (the model's distribution, vLLM's default) or processed_logprobs (after penalties and masks)."""
    log_stats: bool = True
    """Print the KV capacity at start."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (None: off); a dict or JSON text is parsed by ``SpeculativeConfig.parse``."""

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not supported; choose one of "
                             f"{', '.join(LOGPROBS_MODES)}")


def field_default(cls: type, name: str) -> Any:
    """The declared default of a dataclass field (for CLI defaults, written once)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def field_doc(cls: type, name: str) -> str:
    """The one-line docstring written under a dataclass field (used as CLI help)."""
    import inspect

    src = inspect.getsource(cls)
    m = re.search(rf"^\s+{name}:.*\n\s+\"\"\"(.*?)\"\"\"", src, re.MULTILINE)
    return m.group(1) if m else ""
