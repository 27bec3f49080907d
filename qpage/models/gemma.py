"""Gemma 2 and Gemma 3 (text) over the paged KV cache, on the Llama family's attention, linears
and loader (``models.llama``).

What differs from a Llama layer: RMSNorm scales by ``1 + w`` (the checkpoint stores ``w``);
norms before and after both attention and MLP; GeGLU (tanh-approximated GELU) in the MLP; the
embedding multiplied by sqrt(hidden); attention scaled by ``query_pre_attn_scalar``; local
layers that attend to a sliding window and, in Gemma 3, rotate with their own rope base; in
Gemma 2, attention scores and output logits soft-capped (``cap * tanh(x / cap)``); in Gemma
3, q/k norms. A Gemma 3 vision-language checkpoint's language model runs as text only: its
vision tower and projector are not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from qpage.formats.gguf_model import GgufTensor
from qpage.formats.safetensors_io import LazyTensor
from qpage.layers.attention.backends import AttentionBackend
from qpage.layers.attention.metadata import StepMetadata
from qpage.layers.norms import RMSNorm
from qpage.layers.rotary import RotaryEmbedding
from qpage.models.arch import ArchConfig
from qpage.models.fused_decode import decode_only, run_decode_stack
from qpage.models.llama import MLP, Attention, DecoderLayer, KVCache, LlamaForCausalLM
from qpage.models.sharding import WHOLE_MODEL, PartLoader

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
"""Tensors of a Gemma 3 vision-language checkpoint that the text model does not use."""
LANGUAGE_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                     "language_model.lm_head.": "lm_head."}
"""Where such a checkpoint keeps the language model's tensors (older and newer transformers)."""


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight`` (computed in fp32, as the reference does); ``weight`` is
    the checkpoint's. GGUF files store ``1 + w``; their reader gives back ``w``."""

    scale: torch.Tensor | None = None
    """``1 + weight`` in the weight's dtype, kept once the model is prepared (its weights final);
    before that (calibration refills the weights) computed at each call."""

    def prepare(self) -> None:
        self.scale = (self.weight.float() + 1.0).to(self.weight.dtype)

    def effective_weight(self) -> torch.Tensor:
        return self.scale if self.scale is not None else (self.weight.float() + 1.0).to(self.weight.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32:  # half precision: scale by 1 + w in fp32 and round once, as the reference
            if residual is None:
                return self._reference(x)
            residual = x + residual
            return self._reference(residual), residual
        scale = self.effective_weight()
        if residual is None:
            return self.ops.rms_norm(x, scale, self.eps)
        return self.ops.add_rms_norm(x, residual, scale, self.eps)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.weight.float() + 1.0)).to(x.dtype)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ops.gelu_tanh_mul(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    """Norms around attention and MLP, each pair: ``h + post(f(pre(h)))``."""

    def __init__(self, c: ArchConfig, window: int | None, rope_index: int) -> None:
        super().__init__()
        self.rope_index = rope_index
        """Which of the model's rotary tables this layer uses (0 global, 1 local)."""
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, window)
        if c.qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GemmaMLP(c)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    forward = DecoderLayer.forward
    """The layer on its own (calibration), as a Llama layer runs it through ``step``."""

    def step(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        cache: KVCache, meta: StepMetadata, backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form, as ``llama.DecoderLayer.step``: the post-norms' outputs are
        added to the residual by the next pre-norm."""
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h)  # type: ignore[assignment]
        else:
            h, residual = self.input_layernorm.forward(h, residual)  # type: ignore[misc]
        h = self.self_attn.forward(h, cos, sin, cache, meta, backend)
        h = self.post_attention_layernorm.forward(h)  # type: ignore[assignment]
        h, residual = self.pre_feedforward_layernorm.forward(h, residual)  # type: ignore[misc]
        h = self.mlp.forward(h)
        return self.post_feedforward_layernorm.forward(h), residual  # type: ignore[return-value]

    def fused_norms(self) -> tuple[GemmaRMSNorm, GemmaRMSNorm, GemmaRMSNorm, GemmaRMSNorm]:
        """(before attention, before the MLP, of the attention's output, of the MLP's output)."""
        return (self.input_layernorm, self.pre_feedforward_layernorm, self.post_attention_layernorm,
                self.post_feedforward_layernorm)

    def norms(self) -> list[GemmaRMSNorm]:
        """The four norms of the hidden state (not q/k's)."""
        return [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm]


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, c: ArchConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__(c, max_positions, dtype)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.local_rotary = (None if c.local_rope_theta is None else
                             RotaryEmbedding(c.head_dim, max_positions, c.local_rope_theta, None, dtype))
        self.embed_scale = float(torch.tensor(c.hidden_size**0.5, dtype=dtype))  # as the reference rounds it

    def build_layer(self, c: ArchConfig, i: int, max_positions: int) -> nn.Module:
        local = c.layer_window(i) is not None and c.local_rope_theta is not None  # its rope, whatever the context
        return GemmaDecoderLayer(c, c.attention_windows(max_positions)[i], int(local))

    def rotary_for(self, i: int) -> RotaryEmbedding:
        layer = self.layers[i]
        assert isinstance(layer, GemmaDecoderLayer)
        return self.local_rotary if layer.rope_index == 1 and self.local_rotary is not None else self.rotary

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        if self.local_rotary is not None:
            self.local_rotary.cos = self.local_rotary.cos.to(device)
            self.local_rotary.sin = self.local_rotary.sin.to(device)

    def prepare(self, dequantize_weights: bool = False) -> None:
        super().prepare(dequantize_weights)
        for layer in self.layers:
            for norm in layer.norms():
                norm.ops = self.ops

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
        metas: list[StepMetadata], backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden] (``LlamaForCausalLM.forward``)."""
        h = self.embed_tokens.forward(input_ids) * self.embed_scale
        ropes = [self.rotary.lookup(positions)]
        if self.local_rotary is not None:
            ropes.append(self.local_rotary.lookup(positions))
        if self.decode_stack is not None and decode_only(metas[0]):
            h, res = run_decode_stack(self.decode_stack, h, ropes, caches, metas)  # type: ignore[arg-type]
            return self.norm.forward(h, res)[0]  # type: ignore[index]
        residual = None
        for layer, cache, meta in zip(self.layers, caches, metas, strict=True):
            cos, sin = ropes[min(layer.rope_index, len(ropes) - 1)]
            h, residual = layer.step(h, residual, cos, sin, cache, meta, backend)
        assert residual is not None
        return self.norm.forward(h, residual)[0]  # type: ignore[index]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        out = super().weight_targets()
        for i, layer in enumerate(self.layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                p = layer.get_submodule(name).weight
                out[f"model.layers.{i}.{name}.weight"] = (p, 0, p.shape[0])
        return out

    def load_weights(self, tensors: Iterable[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]],
                     parts: PartLoader = WHOLE_MODEL) -> None:
        super().load_weights(_text_tensors(tensors), parts)


def _text_tensors(tensors: Iterable[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]]
                  ) -> Iterator[tuple[str, str, torch.Tensor | LazyTensor | GgufTensor]]:
    """The language model's tensors under a causal LM's names (a Gemma 3 vision-language
    checkpoint's language model moved to the top; its vision tower left out)."""
    for file, name, t in tensors:
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, to in LANGUAGE_PREFIXES.items():
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        yield file, name, t
