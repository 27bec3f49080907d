"""Which quantized-linear format a checkpoint's ``quantization_config`` describes."""

from __future__ import annotations

from typing import Any

from qpage.formats.awq import AwqConfig
from qpage.formats.bnb import BnbConfig
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.fp8 import Fp8Config
from qpage.formats.gguf_model import GgufConfig
from qpage.formats.gptq import GptqConfig
from qpage.formats.mxfp4 import Mxfp4Config

LinearConfig = GptqConfig | AwqConfig | CtIntConfig | Fp8Config | GgufConfig | BnbConfig | Mxfp4Config
SUPPORTED = ("gptq", "awq (GEMM)", "compressed-tensors (pack-quantized INT4/INT8, FP8)", "fp8",
             "bitsandbytes (4-bit NF4/FP4)", "mxfp4 (gpt-oss)", "gguf (a .gguf file)")


def linear_config(qc: dict[str, Any], where: str) -> LinearConfig:
    """Parse and check ``qc``; the error names the setting and what qpage reads instead."""
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "gguf":
        return GgufConfig()
    if method == "mxfp4":
        return Mxfp4Config.from_json(qc, where)
    if method == "bitsandbytes":
        return BnbConfig.from_json(qc, where)
    if method == "gptq":
        return GptqConfig.from_json(qc, where)
    if method == "awq":
        return AwqConfig.from_json(qc, where)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if len(groups) == 1:
            (group,) = groups.values()
            weights = group.get("weights") or {}
            if weights.get("type") == "int":
                return CtIntConfig.from_weights(weights, group.get("format") or qc.get("format"), where)
    if method in ("compressed-tensors", "fp8"):
        return Fp8Config.from_json(qc, where)
    raise ValueError(f"{where}: quantization_config quant_method={method!r} is not supported yet; qpage reads "
                     f"{', '.join(SUPPORTED)} checkpoints")
