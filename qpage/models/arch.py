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
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
"""Mixture-of-experts models (``models.moe``): each sparse layer's MLP is a router and experts."""
NOT_YET = {"DeepseekV3ForCausalLM": "DeepSeek-V3's latent attention is not supported",
           "DeepseekV2ForCausalLM": "DeepSeek-V2's latent attention is not supported"}
"""Architectures people ask for that qpage refuses with a reason (rather than only "not supported")."""
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
"""The Gemma layer (``models.gemma``): (1 + w) norms before and after attention and MLP, GeGLU,
the embedding scaled by sqrt(hidden), local and global layers."""
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "sliding_window": 4096}
"""transformers' ``Gemma3TextConfig`` defaults: published Gemma 3 configs (the vision-language
ones' ``text_config`` above all) leave these fields out."""
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
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer, "sliding_attention" (attends to the last ``sliding_window`` positions) or
    "full_attention"; None: every layer is alike (windowed when ``sliding_window`` is set)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this to the -1/2 (else by head_dim to the -1/2)."""
    attn_logit_softcap: float | None = None
    """Scores pass through ``cap * tanh(s / cap)`` before the softmax (Gemma 2)."""
    final_logit_softcap: float | None = None
    """Likewise for the output logits."""
    local_rope_theta: float | None = None
    """Rope base of the sliding-window layers when it differs from ``rope_theta`` (Gemma 3's
    local layers; they take no ``rope_scaling`` then)."""
    num_experts: int = 0
    """Routed experts of each sparse layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's MLP width."""
    norm_topk_prob: bool = False
    """The top-k routing weights are renormalised to sum to 1 (else the softmax's values)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token also runs, its output gated by a sigmoid (Qwen2-MoE; 0: none)."""
    sparse_layers: tuple[bool, ...] | None = None
    """Per layer, whether its MLP is the experts (else a dense MLP of ``intermediate_size``)."""
    expert_bias: bool = False
    """The router and every expert projection have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU: gate clamped above and up to +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate); None: plain SiLU(gate) * up."""
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    """A learned logit per head joins each softmax, attending to nothing (gpt-oss)."""

    @property
    def fused_checkpoint(self) -> bool:
        """The checkpoint holds ``qkv_proj`` and ``gate_up_proj`` as they run (``FUSED_CHECKPOINTS``)."""
        return self.architecture in FUSED_CHECKPOINTS

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (positions it attends to, its own included), or None."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def attention_windows(self, max_positions: int) -> list[int | None]:
        """Each layer's window where it is shorter than the context, else None (a window as long
        as the context changes nothing)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return [w if w is not None and w < max_positions else None for w in windows]

    def is_sparse(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is a mixture of experts."""
        return self.sparse_layers is not None and self.sparse_layers[i]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling or None); LongRoPE's scaling gets the original and full context lengths."""
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None if rtype == "default" else dict(params)
    else:
        theta, scaling = float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
        if not scaling.get("original_max_position_embeddings") and not cfg.get("original_max_position_embeddings"):
            raise ValueError(f"{source}: yarn rope scaling needs original_max_position_embeddings")
        scaling = {"max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
                   "original_max_position_embeddings": cfg.get("original_max_position_embeddings"), **scaling}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = dict(scaling)
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not original:
            raise ValueError(f"{source}: longrope rope scaling needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
        scaling["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 4096))
    return theta, scaling


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
    if arch in NOT_YET:
        raise ValueError(f"{source}: {arch}: {NOT_YET[arch]}; qpage runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {arch!r} is not supported; qpage runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM, Phi-3/3.5/4, "
            "Gemma 2/3, Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss)"
        )
    if arch == "Gemma3ForConditionalGeneration":
        cfg = _gemma3_text(cfg, source)
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        cfg = {**cfg, **{k: v for k, v in GEMMA3_TEXT_DEFAULTS.items() if cfg.get(k) is None}}
    gemma = arch in GEMMA_ARCHITECTURES
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"{source}: hidden activation {act!r} is not supported for {arch}; qpage runs "
                         f"{'gelu_pytorch_tanh' if gemma else 'silu'}")
    rope_params = cfg.get("rope_parameters") or {}
    partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} (rotary embedding on part of each head, as in "
                         "Phi-4-mini) is not supported yet; qpage rotates whole heads")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg, source)
        if gemma:
            return _gemma(cfg, source, arch, scaling)
        is_qwen = arch.startswith("Qwen")
        layers = int(cfg["num_hidden_layers"])
        sliding = cfg.get("sliding_window")
        if is_qwen and not cfg.get("use_sliding_window", False):
            sliding = None
        types = cfg.get("layer_types")
        if sliding and is_qwen and not types:  # Qwen windows the layers from max_window_layers on
            first = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
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
            qkv_bias=True if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") else attn_bias,
            o_bias=False if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quantization=_quantization(cfg, source),
            layer_types=_layer_types(types, layers, source) if sliding and types else None,
            **(_moe(cfg, arch, layers, source) if arch in MOE_ARCHITECTURES else {}),
        )
    except KeyError as e:
        raise ValueError(f"{source}: required field {e.args[0]!r} is missing") from None


def _moe(cfg: dict[str, Any], arch: str, layers: int, source: str) -> dict[str, Any]:
    """The experts' fields: Qwen's sparse layers are those not in ``mlp_only_layers`` at every
    ``decoder_sparse_step``-th layer; Mixtral's and gpt-oss's are all, their top-k weights
    renormalised (a softmax over the chosen experts' logits); gpt-oss's experts and router have
    biases, its SwiGLU is clamped, its attention has sinks."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"{source}: {arch} needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts, got "
                         f"{experts} and {top_k}")
    if arch == "GptOssForCausalLM":
        return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": True, "expert_bias": True,
                "moe_intermediate_size": int(cfg["intermediate_size"]), "sparse_layers": (True,) * layers,
                "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
                "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "attention_sinks": True}
    if arch == "MixtralForCausalLM":
        if float(cfg.get("router_jitter_noise") or 0.0):
            raise ValueError(f"{source}: router_jitter_noise is a training setting; set it to 0")
        return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": int(cfg["intermediate_size"]), "sparse_layers": (True,) * layers}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": bool(cfg.get("norm_topk_prob")),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]), "shared_expert_intermediate_size": shared,
            "sparse_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))}


def _layer_types(types: list[str], layers: int, source: str) -> tuple[str, ...]:
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types must name sliding_attention or full_attention for each of the "
                         f"{layers} layers")
    return tuple(types)


def _gemma3_text(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The language model's config inside a Gemma 3 vision-language config (qpage runs its text
    part; the vision tower's weights are not loaded)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: a Gemma3ForConditionalGeneration config needs its text_config")
    return {**text, "architectures": ["Gemma3ForConditionalGeneration"],
            "quantization_config": cfg.get("quantization_config", text.get("quantization_config")),
            "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype")}


def _gemma(cfg: dict[str, Any], source: str, arch: str, scaling: dict[str, Any] | None) -> ArchConfig:
    """Gemma 2 and 3: pre- and post-norms, GeGLU, local (sliding-window) and global layers;
    Gemma 3's local layers have their own rope base, Gemma 2 caps attention and output logits.
    Defaults are the reference configs' where a config leaves a field out."""
    gemma2 = arch == "Gemma2ForCausalLM"
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    pattern = 2 if gemma2 else int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    types = _layer_types(cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                                    for i in range(layers)], layers, source)
    theta, local_theta = float(cfg.get("rope_theta", 10000.0)), None
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (transformers >= 5)
        full, local = params["full_attention"], params.get("sliding_attention", {})
        theta = float(full.get("rope_theta", 1e6))
        local_theta = float(local.get("rope_theta", 10000.0))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope scaling on the sliding-window layers is not supported")
        scaling = None if full.get("rope_type", "default") == "default" else dict(full)
    elif not gemma2:
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: bidirectional attention (an embedding model) is not supported; qpage "
                         "runs causal language models")
    hidden = int(cfg["hidden_size"])
    attn_cap = cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)  # an explicit null: no cap
    final_cap = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
    window = cfg.get("sliding_window", 4096)
    return ArchConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or 256),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False, qk_norm=not gemma2, sliding_window=int(window) if window else None,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        quantization=_quantization(cfg, source), hidden_act="gelu_pytorch_tanh",
        layer_types=types if window else None,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
        final_logit_softcap=float(final_cap) if final_cap else None,
        local_rope_theta=local_theta,
    )
