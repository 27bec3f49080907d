"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM, Phi-3/3.5/4) over a paged KV cache.

q/k/v and gate/up are fused into one linear each (fewer, larger matmuls); the loader
slices the checkpoint's separate tensors into them (Phi-3's checkpoints store them fused). Linears come from one factory
(``make_linear``) so quantized and sharded variants can be swapped in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from qpage.formats import bnb
from qpage.formats.detect import LinearConfig, linear_config
from qpage.formats.gguf_model import GgufConfig, GgufTensor
from qpage.formats.safetensors_io import LazyTensor
from qpage.kernels.cpu.native_decode import DecodeStack
from qpage.layers.attention.backends import AttentionBackend
from qpage.layers.attention.kv_format import LayerKV
from qpage.layers.attention.metadata import StepMetadata
from qpage.layers.linear.block_linear import BlockLinear
from qpage.layers.linear.embedding import Embedding
from qpage.layers.linear.factory import Linear, make_linear
from qpage.layers.linear.fp8_linear import Fp8Linear
from qpage.layers.linear.quant_linear import IntLinear
from qpage.layers.moe import SparseMoe
from qpage.layers.norms import RMSNorm
from qpage.layers.ops import TORCH_OPS, TorchOps, select_ops
from qpage.layers.rotary import RotaryEmbedding
from qpage.models.arch import ArchConfig
from qpage.models.fused_decode import build_decode_stack, decode_only, run_decode_stack
from qpage.models.sharding import WHOLE_MODEL, PartLoader

KVCache = LayerKV
QuantLinear = IntLinear | Fp8Linear | BlockLinear
QUANT_LINEARS = (IntLinear, Fp8Linear, BlockLinear)
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight", "weight_scale", "weight_scale_inv", "input_scale",
                  "weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx", *bnb.SUFFIXES)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def projections(c: ArchConfig) -> list[tuple[str, str, int, int]]:
    """Each checkpoint projection of a decoder layer -> (the fused module that holds it,
    first output row there, rows). q/k/v live in ``qkv_proj``, gate/up in ``gate_up_proj``;
    a fused checkpoint (Phi-3) stores them so."""
    n = c.intermediate_size
    if c.fused_checkpoint:
        return [("self_attn.qkv_proj", "self_attn.qkv_proj", 0, c.q_size + 2 * c.kv_size),
                ("self_attn.o_proj", "self_attn.o_proj", 0, c.hidden_size),
                ("mlp.gate_up_proj", "mlp.gate_up_proj", 0, 2 * n),
                ("mlp.down_proj", "mlp.down_proj", 0, c.hidden_size)]
    return [("self_attn.q_proj", "self_attn.qkv_proj", 0, c.q_size),
            ("self_attn.k_proj", "self_attn.qkv_proj", c.q_size, c.kv_size),
            ("self_attn.v_proj", "self_attn.qkv_proj", c.q_size + c.kv_size, c.kv_size),
            ("self_attn.o_proj", "self_attn.o_proj", 0, c.hidden_size),
            ("mlp.gate_proj", "mlp.gate_up_proj", 0, n),
            ("mlp.up_proj", "mlp.gate_up_proj", n, n),
            ("mlp.down_proj", "mlp.down_proj", 0, c.hidden_size)]


def has_bias(c: ArchConfig, name: str) -> bool:
    """Whether the checkpoint projection ``name`` (of ``projections``) has a bias."""
    if name.startswith("mlp.experts."):
        return c.expert_bias
    if name == "self_attn.o_proj":
        return c.o_bias
    return c.qkv_bias if name.startswith("self_attn.") else c.mlp_bias


def linear_quant(c: ArchConfig) -> LinearConfig | None:
    """How the model's linears are stored (None: dense)."""
    return linear_config(c.quantization, "config.json") if c.quantization else None


class Attention(nn.Module):
    def __init__(self, c: ArchConfig, window: int | None = None) -> None:
        """``window``: the layer attends to its last ``window`` positions only (None: all)."""
        super().__init__()
        self.c = c
        q = linear_quant(c)
        self.qkv_proj = make_linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias, q)
        self.o_proj: nn.Module = make_linear(c.o_proj_inputs or c.q_size, c.hidden_size, c.o_bias, q)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.attention_scale
        self.window = window
        self.softcap = c.attn_logit_softcap
        self.sinks = nn.Parameter(torch.empty(c.num_heads), requires_grad=False) if c.attention_sinks else None
        """One learned logit per head in every softmax (gpt-oss), or None."""
        self.ops: TorchOps = TORCH_OPS

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        meta: StepMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        c = self.c
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(t, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        nq = c.num_heads
        if self.q_norm is not None and self.k_norm is not None:  # in place on the projection's output
            self.ops.rms_norm_heads_(qkv[:, :nq], self.q_norm.effective_weight(), self.q_norm.eps)
            self.ops.rms_norm_heads_(qkv[:, nq : nq + c.num_kv_heads], self.k_norm.effective_weight(), self.k_norm.eps)
        q, k = self.ops.rope_qk(qkv, cos, sin, nq, c.num_kv_heads)
        v = qkv[:, nq + c.num_kv_heads :]
        q, k, v = cache.transform.apply(q, k, v)  # centering/rotation of a quantized cache (exact)
        backend.write_cache(k, v, cache, meta.slot_mapping)
        out = cache.transform.restore(backend.attend(q, k, v, cache, meta, self.scale, self.window,
                                                              self.softcap, self.sinks))
        return self.o_proj.forward(out.reshape(t, c.q_size))


class MLP(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        q = linear_quant(c)
        self.gate_up_proj = make_linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, q)
        self.down_proj: nn.Module = make_linear(c.down_proj_inputs or c.intermediate_size, c.hidden_size,
                                                c.mlp_bias, q)
        self.ops: TorchOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ops.silu_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    rope_index = 0
    """Which of the model's rotary tables the layer uses (one here)."""

    def __init__(self, c: ArchConfig, window: int | None = None, mlp: nn.Module | None = None) -> None:
        """``mlp``: the layer's MLP when it is not the dense one (a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(c)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        meta: StepMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        """The layer on its own (calibration): input hidden states -> output hidden states."""
        out, residual = self.step(h.clone(), None, cos, sin, cache, meta, backend)
        return out + residual

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """(before attention, before the MLP, of the attention's output, of the MLP's output)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def step(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        cache: KVCache, meta: StepMetadata, backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form: the layer's output is ``h_out + residual_out``, and the add is
        fused into the next norm. ``residual`` None: ``h`` is the input of the first layer (and,
        with the in-place ops of ``layers.ops``, is updated in place as the residual)."""
        # NOTE: submodules are called through .forward: nn.Module.__call__'s hook handling
        # costs time on each of the step's hundreds of calls, and qpage registers no hooks.
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h)  # type: ignore[assignment]
        else:
            h, residual = self.input_layernorm.forward(h, residual)  # type: ignore[misc]
        h = self.self_attn.forward(h, cos, sin, cache, meta, backend)
        h, residual = self.post_attention_layernorm.forward(h, residual)  # type: ignore[misc]
        return self.mlp.forward(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ArchConfig, max_positions: int, dtype: torch.dtype) -> None:
        """``c`` is the shape this process holds: the whole model, or a tensor-parallel rank's
        part (``models.sharding``, which also wraps the split layers in their collectives)."""
        super().__init__()
        self.config = c
        self.dtype = dtype
        gguf = isinstance(linear_quant(c), GgufConfig)  # a GGUF file: every tensor keeps its own format
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, packed=gguf, tied=c.tie_word_embeddings)
        self.layers = nn.ModuleList(self.build_layer(c, i, max_positions) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        head_quant = linear_quant(c) if gguf else None  # only a GGUF file's head may be quantized
        self.lm_head: nn.Module | None = (
            None if c.tie_word_embeddings else make_linear(c.hidden_size, c.vocab_size, False, head_quant))
        self.rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling, dtype)
        self.ops: TorchOps = TORCH_OPS
        """The small ops every layer uses (``layers.ops``), chosen at ``prepare``."""
        self.decode_stack: DecodeStack | None = None
        """Decode steps in one C call (``models.fused_decode``), when the model fits; else None.
        The runner drops it at start when its attention backend or KV cache do not fit."""
        self.kv_scales: dict[int, tuple[float, float]] = {}
        """Static FP8 KV scales per layer from the checkpoint (vLLM's ``self_attn.k_scale``)."""

    embed_scale = 1.0
    """The embedding's rows are multiplied by this (Gemma's sqrt(hidden))."""
    def build_layer(self, c: ArchConfig, i: int, max_positions: int) -> nn.Module:
        """Decoder layer ``i`` (its window: ``ArchConfig.attention_windows``)."""
        return DecoderLayer(c, c.attention_windows(max_positions)[i])

    def rotary_for(self, i: int) -> RotaryEmbedding:
        """The rotary tables of layer ``i`` (one for all layers here)."""
        return self.rotary

    def layer_projections(self, i: int) -> list[tuple[str, str, int, int]]:
        """Layer ``i``'s checkpoint projections (``projections``: module, fused module, offset, rows)."""
        return projections(self.config)

    def attention_features(self) -> frozenset[str]:
        """What the layers ask of the attention backend beyond plain causal attention
        (``layers.attention.selector.FEATURES``)."""
        attns = [layer.self_attn for layer in self.layers]
        return frozenset({*(["sliding-window"] if any(a.window is not None for a in attns) else []),
                          *(["softcap"] if any(a.softcap is not None for a in attns) else []),
                          *(["sinks"] if any(a.sinks is not None for a in attns) else [])})

    def to_device(self, device: torch.device) -> None:
        self.to(device)
        self.rotary.cos = self.rotary.cos.to(device)
        self.rotary.sin = self.rotary.sin.to(device)

    def prepare(self, dequantize_weights: bool = False) -> None:
        """Pick kernels for the loaded weights (once, after loading and moving); with
        ``dequantize_weights`` quantized weights are dequantized rather than kept packed."""
        device, dtype = self.norm.weight.device, self.dtype
        for m in self.modules():
            if isinstance(m, Linear):
                m.prepare()
            elif isinstance(m, (*QUANT_LINEARS, Embedding)):
                m.prepare(dtype, dequantize_weights)
        self.ops = select_ops(device, dtype)
        self.norm.ops = self.ops
        for layer in self.layers:  # q_norm/k_norm run through self_attn's ops (rms_norm_heads_)
            for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp):
                m.ops = self.ops
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.prepare()
            elif isinstance(m, SparseMoe):
                m.prepare(self.ops)
        self.decode_stack = build_decode_stack(self)

    def runs_own_threads(self) -> bool:
        """Whether matmuls run on the C kernels, which split rows across the cores themselves:
        NumPy's BLAS should then not keep a second pool of spinning threads (both pools on the
        same cores slowed decode ~1.8x, even with a large matrix left on BLAS)."""
        return any(m.own_threads for m in self.modules() if isinstance(m, (Linear, Embedding, *QUANT_LINEARS)))

    def quant_linears(self) -> list[QuantLinear]:
        """The model's quantized linear layers."""
        return [m for m in self.modules() if isinstance(m, QUANT_LINEARS)]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
        metas: list[StepMetadata], backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]; ``caches`` and ``metas``
        (the step's attention metadata of each layer's KV group) one per layer."""
        h = self.embed_tokens.forward(input_ids)
        cos, sin = self.rotary.lookup(positions)
        if self.decode_stack is not None and decode_only(metas[0]):
            h, res = run_decode_stack(self.decode_stack, h, [(cos, sin)], caches, metas)  # type: ignore[arg-type]
            return self.norm.forward(h, res)[0]
        residual = None
        for layer, cache, meta in zip(self.layers, caches, metas, strict=True):
            h, residual = layer.step(h, residual, cos, sin, cache, meta, backend)
        return self.norm.forward(h) if residual is None else self.norm.forward(h, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab]; with tensor parallelism on rank 0 only (None on the others)."""
        if self.lm_head is None:
            return self.embed_tokens.head(hidden.contiguous())
        return self.lm_head.forward(hidden)

    # ------------------------------------------------------------------ weights
    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint tensor name -> (destination parameter, row offset, rows).

        Fused projections take their parts at row offsets; every other tensor fills its
        parameter whole (offset 0, all rows).
        """
        c = self.config
        out: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, p: torch.Tensor) -> None:
            out[name] = (p, 0, p.shape[0])

        if self.embed_tokens.weight is not None:
            whole("model.embed_tokens.weight", self.embed_tokens.weight)
        whole("model.norm.weight", self.norm.weight)
        if isinstance(self.lm_head, Linear):
            whole("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            for name, fused, off, rows in self.layer_projections(i):
                mod = layer.get_submodule(fused)
                if isinstance(mod, Linear):
                    out[f"{pre}{name}.weight"] = (mod.weight, off, rows)
                if has_bias(c, name):
                    out[f"{pre}{name}.bias"] = (mod.bias, off, rows)
            attn = layer.self_attn
            if attn.sinks is not None:
                whole(f"{pre}self_attn.sinks", attn.sinks)
            if attn.q_norm is not None and attn.k_norm is not None:
                whole(f"{pre}self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{pre}self_attn.k_norm.weight", attn.k_norm.weight)
            whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return out

    def quant_targets(self) -> dict[str, tuple[QuantLinear | Embedding, int, int]]:
        """Quantized projection prefix -> (fused layer, first output column, columns)."""
        out: dict[str, tuple[QuantLinear | Embedding, int, int]] = {}
        if self.embed_tokens.packed:
            out["model.embed_tokens"] = (self.embed_tokens, 0, self.config.vocab_size)
        if isinstance(self.lm_head, QUANT_LINEARS):
            out["lm_head"] = (self.lm_head, 0, self.config.vocab_size)
        for i, layer in enumerate(self.layers):
            for name, fused, off, cols in self.layer_projections(i):
                mod = layer.get_submodule(fused)
                if isinstance(mod, QUANT_LINEARS):
                    out[f"model.layers.{i}.{name}"] = (mod, off, cols)
        return out

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]],
                     parts: PartLoader = WHOLE_MODEL) -> None:
        """Copy (file, name, tensor) triples into the model, checking every shape. ``parts``
        takes what this process holds of each tensor: the whole, or a rank's slices (of a
        ``LazyTensor``, only they are read)."""
        targets = self.weight_targets()
        qtargets = self.quant_targets()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        pending_file: dict[str, str] = {}
        seen: set[str] = set()
        found: dict[int, dict[str, float]] = {}
        for file, name, lazy in tensors:
            prefix, _, suffix = name.rpartition(".")
            prefix, suffix = bnb.split_name(name) or (prefix, suffix)
            quant_part = prefix in qtargets and suffix in QUANT_SUFFIXES
            if not quant_part:  # a quantized projection's parts go to ``parts.quant`` together
                lazy = parts.dense(name, lazy)
            if quant_part:
                if suffix == "input_scale":
                    continue  # static FP8 activation scales: qpage keeps activations unquantized
                held = pending.setdefault(prefix, {})
                held[suffix] = lazy  # read in parts.quant
                pending_file[prefix] = file
                if qtargets[prefix][0].wants(held):
                    parts.quant(qtargets[prefix], prefix, pending.pop(prefix), file)
                    seen.add(prefix)
                continue
            t = lazy.read() if isinstance(lazy, LazyTensor) else lazy
            m = _KV_SCALE.match(name)
            if m:
                if t.numel() != 1 or not torch.isfinite(t).all() or float(t) <= 0:
                    raise ValueError(f"{file}: {name} must be one positive finite number, got shape "
                                     f"{tuple(t.shape)}")
                found.setdefault(int(m.group(1)), {})[m.group(2)] = float(t)
                continue
            if name not in targets:
                if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                    continue
                raise ValueError(
                    f"{file}: tensor {name!r} is not part of a {self.config.architecture}; "
                    "is the config.json from the same checkpoint?"
                )
            dest, off, rows = targets[name]
            want = (rows, *dest.shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                    "from config.json; the checkpoint and its config disagree"
                )
            dest[off : off + rows].copy_(t)
            seen.add(name)
        self.kv_scales = {i: (d["k"], d["v"]) for i, d in found.items() if "k" in d and "v" in d}
        for prefix, held in pending.items():  # no g_idx (allowed: groups in order)
            parts.quant(qtargets[prefix], prefix, held, pending_file[prefix])
            seen.add(prefix)
        missing = sorted((set(targets) | set(qtargets)) - seen)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(
                f"checkpoint is missing tensors {missing[:5]}{more}; it is incomplete or not a "
                f"{self.config.architecture}"
            )
