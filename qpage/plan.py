"""``qpage plan``: what fits on one card, for each weight scheme x KV-cache dtype (docs/serving.md).

With ``tensor_parallel_size`` N each card holds one rank's part (``models.sharding``): the
figures are those of the largest part, weights and KV bytes per token, per card.

Weights: every linear of the decoder at the scheme's bits plus its scales (and zeros,
``g_idx``) in the layout qpage loads; embeddings, the LM head, norms and biases in FP16.
KV bytes per token: the engine's own formula (``KVCacheSpec.bytes_per_token``), the FP8, int8
and int4 caches' per-token scales (and int4's zeros) included. Token capacity: what is left
of the card after the weights and a fixed allowance for activations and the runtime, in
whole 16-token blocks. A mixture of experts holds every expert (all its parameters) but runs
only its top-k per token (its active parameters, stated beside). A model with sliding-window
layers beside global ones is planned with the engine's layout, its local layers keeping only
their window (``kv_layout``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qpage.config import BLOCK_SIZE, SchedulerConfig, parse_size
from qpage.engine.kv_cache import kv_layout
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.kv_layout import KVLayout
from qpage.models.arch import GEMMA_ARCHITECTURES, ArchConfig, parse_arch_config
from qpage.models.sharding import check_parallel, plan_shards

CONFIG_DIR = Path(__file__).parent / "data" / "configs"
DEFAULT_OVERHEAD = "1.5GiB"


@dataclass(frozen=True)
class WeightScheme:
    name: str
    bits: int
    group_size: int | None
    """Input features per scale group; None = one scale per output channel."""
    scale_bytes: int
    zero_bits: int
    g_idx: bool


WEIGHT_SCHEMES = (
    WeightScheme("FP16", 16, None, 0, 0, False),
    WeightScheme("INT8 g128", 8, 128, 2, 8, True),
    WeightScheme("INT4 g128", 4, 128, 2, 4, True),
    WeightScheme("FP8", 8, None, 4, 0, False),
)
KV_DTYPES = (("FP16", "auto"), ("FP8", "fp8"), ("INT8", "int8"), ("K8V4", "k8v4"), ("INT4", "int4"))


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_arch(model_or_config: str) -> tuple[str, ArchConfig]:
    """A bundled name (``Llama-3-8B``), a config.json path, or a model folder."""
    p = Path(model_or_config).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        bundled = CONFIG_DIR / f"{model_or_config}.json"
        if not bundled.is_file():
            raise FileNotFoundError(
                f"{model_or_config!r} is neither a config.json, a model folder, nor a bundled config; "
                f"bundled: {', '.join(bundled_configs())}"
            )
        p = bundled
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON ({e})") from None
    name = p.stem if p.parent == CONFIG_DIR else p.parent.name
    return name, parse_arch_config(cfg, str(p))


def _mlp(hidden: int, inter: int) -> list[tuple[int, int]]:
    return [(hidden, inter), (hidden, inter), (inter, hidden)]


def linear_shapes(a: ArchConfig, active: bool = False) -> list[tuple[int, int]]:
    """(in_features, out_features) of every decoder linear; ``active``: only those one token runs
    through (of a mixture of experts, its top-k experts and the shared one)."""
    attn = [(a.hidden_size, a.q_size), (a.hidden_size, a.kv_size), (a.hidden_size, a.kv_size),
            (a.q_size, a.hidden_size)]
    experts = a.experts_per_token if active else a.num_experts
    sparse = (_mlp(a.hidden_size, a.moe_intermediate_size) * experts
              + (_mlp(a.hidden_size, a.shared_expert_intermediate_size) if a.shared_expert_intermediate_size else []))
    return [s for i in range(a.num_layers)
            for s in attn + (sparse if a.is_sparse(i) else _mlp(a.hidden_size, a.intermediate_size))]


def fp16_params(a: ArchConfig) -> int:
    """Parameters kept in FP16 under every scheme: embeddings, head, norms, biases."""
    n = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    norms = 4 if a.architecture in GEMMA_ARCHITECTURES else 2  # Gemma: before and after attention and MLP
    n += a.hidden_size * (norms * a.num_layers + 1)
    if a.qk_norm:
        n += 2 * a.head_dim * a.num_layers
    if a.qkv_bias:
        n += (a.q_size + 2 * a.kv_size) * a.num_layers
    sparse = sum(a.is_sparse(i) for i in range(a.num_layers))  # routers (and shared-expert gates): never quantized
    n += sparse * a.hidden_size * (a.num_experts + bool(a.shared_expert_intermediate_size))
    return n


def weight_bytes(a: ArchConfig, s: WeightScheme) -> int:
    total = 2 * fp16_params(a)
    for k, n in linear_shapes(a):
        total += k * n * s.bits // 8
        groups = -(-k // s.group_size) if s.group_size else 1
        total += groups * n * s.scale_bytes + groups * n * s.zero_bits // 8
        if s.g_idx:
            total += 4 * k
    return total


def num_params(a: ArchConfig, active: bool = False) -> int:
    """All parameters, or (``active``) those one token runs through."""
    return fp16_params(a) + sum(k * n for k, n in linear_shapes(a, active))


@dataclass(frozen=True)
class PlanRow:
    weights: str
    kv: str
    weight_bytes: int
    kv_bytes_per_token: int
    tokens: int
    concurrent: int
    fits: bool


def plan(a: ArchConfig, gpu_memory: int, overhead: int, context_len: int, tp: int = 1,
         windowed: bool = True) -> list[PlanRow]:
    """One row per weight scheme x KV dtype; per card, for the largest of ``tp`` ranks' parts.
    With sliding-window layers (``windowed``; else as if they kept every token) a request holds
    the engine's layout (``kv_layout``): the KV bytes per token are then its average over a
    request of ``context_len``, the tokens the longest request that fits."""
    parts = [p.local_arch(a) for p in plan_shards(a, tp)] if tp > 1 else [a]
    layout = kv_layout(a, context_len) if windowed else KVLayout.plan([None] * a.num_layers)
    chunk = SchedulerConfig().max_num_batched_tokens
    per_req = layout.pages_for(context_len, chunk)
    rows = []
    for s in WEIGHT_SCHEMES:
        wb = max(weight_bytes(part, s) for part in parts)
        for kv_name, kv_dtype in KV_DTYPES:
            spec = KVCacheSpec.from_config(kv_dtype, "per_token", torch.float16)
            page = max(spec.bytes_per_token(layout.slots, p.num_kv_heads, p.head_dim) for p in parts) * BLOCK_SIZE
            per_tok = page // BLOCK_SIZE if len(layout.groups) == 1 else round(per_req * page / context_len)
            pages = max(gpu_memory - overhead - wb, 0) // page
            tokens = (pages * BLOCK_SIZE if len(layout.groups) == 1
                      else layout.max_tokens(pages, chunk, max(a.max_position_embeddings, context_len)))
            rows.append(PlanRow(s.name, kv_name, wb, per_tok, tokens, pages // per_req, tokens >= context_len))
    return rows


def format_table(name: str, a: ArchConfig, rows: list[PlanRow], gpu_memory: int, overhead: int, ctx: int,
                 tp: int = 1, windowed: bool = True) -> str:
    gb = 1e9
    cards = f"{tp} cards of" if tp > 1 else "card"
    each = " each" if tp > 1 else ""
    moe = (f" ({num_params(a, active=True) / 1e9:.2f} B active: {a.experts_per_token} of {a.num_experts} experts per "
           "token)" if a.num_experts else "")
    head = (f"{name}: {num_params(a) / 1e9:.2f} B parameters{moe}, {a.num_layers} layers, {a.num_kv_heads} KV heads x "
            f"{a.head_dim}; {cards} {gpu_memory / 2**30:.1f} GiB, {overhead / 2**30:.1f} GiB{each} kept for "
            f"activations and runtime; requests of {ctx} tokens")
    local = sum(w is not None for w in a.attention_windows(ctx))
    if local:
        how = ("they keep only that window: KV tokens is the longest request, KV bytes/token the average over one "
               f"of {ctx}" if windowed else "planned as if they kept every token (--full-kv-cache)")
        head += f"\n{local} of {a.num_layers} layers attend to a {a.sliding_window}-token window; {how}"
    per = " per card" if tp > 1 else ""
    lines = [head, "",
             f"| weights | KV cache | weights GB{per} | KV bytes/token{per} | KV tokens | concurrent @ ctx | fits |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        fits = "yes" if r.fits else ("no: weights too big" if r.tokens == 0 else "no: context too long")
        lines.append(f"| {r.weights} | {r.kv} | {r.weight_bytes / gb:.2f} | {r.kv_bytes_per_token:,} "
                     f"({r.kv_bytes_per_token / 1024:.1f} KiB) | {r.tokens:,} | {r.concurrent} | {fits} |")
    return "\n".join(lines)


def run_plan(model_or_config: str, gpu_memory: str, overhead: str, context_len: int | None,
             as_json: bool = False, tp: int = 1, windowed: bool = True) -> str:
    name, a = load_arch(model_or_config)
    check_parallel(a, tp, name)
    mem, over = parse_size(gpu_memory, "gpu_memory"), parse_size(overhead, "overhead")
    ctx = context_len or min(a.max_position_embeddings, 8192)
    if ctx < 1:
        raise ValueError(f"context_len={ctx} must be at least 1")
    rows = plan(a, mem, over, ctx, tp, windowed)
    if as_json:
        return json.dumps({"model": name, "gpu_memory": mem, "overhead": over, "context_len": ctx,
                           "tensor_parallel_size": tp, "windowed_kv": windowed, "params": num_params(a),
                           "active_params": num_params(a, active=True),
                           "rows": [r.__dict__ for r in rows]}, indent=2)
    return format_table(name, a, rows, mem, over, ctx, tp, windowed)
