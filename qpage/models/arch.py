"""The model shape read from a Hugging Face ``config.json``, for the supported architectures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
FUSED_CHECKPOINTS = ("Phi3ForCausalLM",)
"""Architectures whose checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj`` (qpage's own fused layout)."""


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str
    quantization: dict[str, Any] | None = None
    """``quantization_config`` of a quantized checkpoint (validated by its format reader)."""
    o_proj_inputs: int | None = None
    """o_proj's input width when it is not ``q_size``: a tensor-parallel rank's part whose input
    columns split by whole quantization groups (``models.sharding.ShardPlan.local_arch``)."""
    down_proj_inputs: int | None = None
    """Likewise for down_proj (else ``intermediate_size``)."""

    @property
    def fused_checkpoint(self) -> bool:
        """The checkpoint holds ``qkv_proj`` and ``gate_up_proj`` as they run (``FUSED_CHECKPOINTS``)."""
        return self.architecture in FUSED_CHECKPOINTS

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rtype = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rtype == "default" else dict(params))
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def _quantization(cfg: dict[str, Any], source: str) -> dict[str, Any] | None:
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object")
    from qpage.formats.detect import linear_config

    linear_config(qc, source)  # refuse unsupported settings now, by name
    return dict(qc)


def parse_arch_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    """Read and check the fields qpage needs; refuse what it cannot run, by name."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {arch!r} is not supported; qpage runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM, Phi-3/3.5/4)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported; only 'silu'")
    rope_params = cfg.get("rope_parameters") or {}
    partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} (rotary embedding on part of each head, as in "
                         "Phi-4-mini) is not supported yet; qpage rotates whole heads")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            scaling = dict(scaling)
            original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            if not original:
                raise ValueError(f"{source}: longrope rope scaling needs original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(original)
            scaling["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 4096))
        is_qwen = arch.startswith("Qwen")
        sliding = cfg.get("sliding_window")
        if is_qwen and not cfg.get("use_sliding_window", False):
            sliding = None
        attn_bias = bool(cfg.get("attention_bias", False))
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attn_bias,
            o_bias=False if arch == "Qwen2ForCausalLM" else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quantization=_quantization(cfg, source),
        )
    except KeyError as e:
        raise ValueError(f"{source}: required field {e.args[0]!r} is missing") from None
