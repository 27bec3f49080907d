"""A GGUF file's rotary scaling keys as a Hugging Face config's ``rope_parameters``: Phi-3's
LongRoPE (factor tensors and ``rope.scaling.*``) and YaRN (``rope.scaling.*``)."""

from __future__ import annotations

from typing import Any

from qpage.formats.gguf_reader import GgufFile, GgufFormatError


def longrope(f: GgufFile, arch: str, theta: float) -> dict[str, Any]:
    """Phi-3's LongRoPE as a config's rope_parameters, from the file's factor tensors and keys."""
    original = f.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_short.weight" not in f.tensors or not original:
        raise GgufFormatError(f"{f.path}: rope_factors_long.weight needs rope_factors_short.weight and "
                              f"{arch}.rope.scaling.original_context_length")
    params: dict[str, Any] = {
        "rope_type": "longrope", "rope_theta": theta, "original_max_position_embeddings": int(original),
        "long_factor": [float(v) for v in f.data("rope_factors_long.weight").reshape(-1)],
        "short_factor": [float(v) for v in f.data("rope_factors_short.weight").reshape(-1)]}
    attention = f.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        params["attention_factor"] = float(attention)
    return params


def yarn(f: GgufFile, arch: str, theta: float) -> dict[str, Any]:
    """YaRN as a config's rope_parameters, from ``rope.scaling.*``. gpt-oss's ramp is untruncated,
    as its reference (transformers, ``truncate: false``) runs it; llama.cpp truncates it (the file
    does not say), so the two engines differ there by a little (docs/gguf.md)."""
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(f.require(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(f.require(f"{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(f.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(f.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": arch != "gpt-oss"}
