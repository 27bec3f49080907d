"""GPTQ format reading: v1 zero offsets (AutoGPTQ/GPTQModel) and v2, validated per tensor.

No peer GPTQ writer installs here without a GPU (auto-gptq needs CUDA to quantize),
so the fixtures are built from the documented layout: v1 symmetric 4-bit qzeros read
0x77777777 (zero 8 stored as 7)."""

from __future__ import annotations

import pytest
import torch

from qpage.formats.gptq import GptqConfig, check_linear, pack_linear
from qpage.kernels.packing import dequantize_ref, pack_cols, pack_rows, unpack_cols
from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn


def test_v1_symmetric_zeros_read_as_eight() -> None:
    cfg = GptqConfig.from_json({"bits": 4, "group_size": 32, "sym": True}, "config.json")
    assert cfg.v1
    q = torch.randint(0, 16, (64, 16))
    parts = {"qweight": pack_rows(q, 4), "qzeros": torch.full((2, 2), 0x77777777, dtype=torch.int32),
             "scales": torch.ones(2, 16, dtype=torch.float16)}
    t = check_linear("x", parts, cfg, 64, 16, "f.safetensors")
    assert (unpack_cols(t["qzeros"], 4, 16) == 8).all()
    assert t["g_idx"] is None


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_written_tensors_roundtrip(fmt: str) -> None:
    w = torch.randn(40, 96)
    q, s, z = quantize_rtn(w, 4, 32, sym=False)
    parts = {k.split(".")[-1]: v for k, v in pack_linear("p", q, s, z, 4, 32).items()}
    if fmt == "gptq_v2":  # the same linear as a v2 writer would store it
        parts["qzeros"] = pack_cols(z, 4)
    cfg = GptqConfig.from_json({"bits": 4, "group_size": 32, "sym": False, "checkpoint_format": fmt}, "c")
    t = check_linear("p", parts, cfg, 96, 40, "f")
    got = dequantize_ref(t["qweight"], t["scales"], t["qzeros"], t["g_idx"], bits=4, group_size=32, in_features=96)
    assert torch.allclose(got.t(), dequantize_rtn(q, s, z, 32), atol=1e-3)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="GPTQ bits=3 is not supported"):
        GptqConfig.from_json({"bits": 3}, "config.json")
    with pytest.raises(ValueError, match="group_size=100 is not supported"):
        GptqConfig.from_json({"bits": 4, "group_size": 100}, "config.json")
    with pytest.raises(ValueError, match="checkpoint_format='marlin' is not supported"):
        GptqConfig.from_json({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "config.json")
