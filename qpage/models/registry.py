"""Architecture name -> model class."""

from __future__ import annotations

from torch import nn

from qpage.models.arch import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from qpage.models.gemma import GemmaForCausalLM
from qpage.models.llama import LlamaForCausalLM
from qpage.models.moe import MoeForCausalLM


def _family(name: str) -> type[nn.Module]:
    if name in GEMMA_ARCHITECTURES:
        return GemmaForCausalLM
    return MoeForCausalLM if name in MOE_ARCHITECTURES else LlamaForCausalLM


_REGISTRY: dict[str, type[nn.Module]] = {name: _family(name) for name in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_REGISTRY)}"
        ) from None
