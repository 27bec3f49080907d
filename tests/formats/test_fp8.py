"""FP8 weights: the quantizer's grid, compressed-tensors written by qpage and read back by
qpage and by transformers (through the `compressed-tensors` package, llm-compressor's
format library), and Hugging Face `fp8` block checkpoints read from their documented
layout (no writer for that format installs here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from qpage import LLM
from qpage.eval.perplexity import score_window
from qpage.formats.fp8 import Fp8Config
from qpage.formats.scheme import QuantScheme
from qpage.quantizers.fp8 import E4M3_MAX, dequantize_fp8, quantize_fp8
from qpage.quantizers.pipeline import quantize_checkpoint

IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 2575, 314]


def test_per_channel_grid() -> None:
    w = torch.randn(48, 200) * torch.logspace(-3, 1, 48)[:, None]
    codes, scale = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (48, 1)
    assert torch.equal(codes.float().abs().amax(1), torch.full((48,), E4M3_MAX))  # amax lands on 448
    deq = dequantize_fp8(codes, scale)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; subnormals absolute.
    err = (deq - w).abs()
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10)
    assert (err <= bound * 1.0001).all()


def test_block_grid_with_partial_blocks() -> None:
    w = torch.randn(200, 300)
    codes, scale = quantize_fp8(w, block=128)
    assert scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert blk.abs().max() == E4M3_MAX
    assert (dequantize_fp8(codes, scale, 128) - w).abs().max() <= w.abs().max() * 2**-4


@pytest.fixture(scope="module")
def fp8_dirs(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name in ("fp8", "fp8-block"):
        out[name] = root / name
        quantize_checkpoint(default_model_dir, out[name], QuantScheme.parse(name), progress=False)
    return out


def _logprobs(model: str) -> torch.Tensor:
    return score_window(LLM(model=model, log_stats=False, kv_cache_memory="64MiB", max_model_len=256).llm_engine,
                        IDS, 256)


def _dense_reference(src: Path, dst: Path, block: int | None, scale_key: str = "weight_scale") -> Path:
    """The checkpoint with every FP8 linear dequantized by the reference formula, as a dense folder."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        out: dict[str, torch.Tensor] = {}
        for k, v in t.items():
            if k.endswith("." + scale_key):
                continue
            if v.dtype == torch.float8_e4m3fn:
                out[k] = dequantize_fp8(v, t[k.removesuffix("weight") + scale_key], block).contiguous()
            else:
                out[k] = v
        save_file(out, f)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("name,block", [("fp8", None), ("fp8-block", 128)])
def test_qpage_fp8_checkpoint_equals_its_dequantized_weights(fp8_dirs: dict[str, Path], tmp_path: Path,
                                                              name: str, block: int | None) -> None:
    cfg = json.loads((fp8_dirs[name] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "naive-quantized"
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == ("block" if block else "channel")
    got = _logprobs(str(fp8_dirs[name]))
    ref = _logprobs(str(_dense_reference(fp8_dirs[name], tmp_path / "dense", block)))
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.slow
def test_transformers_loads_qpage_fp8(fp8_dirs: dict[str, Path]) -> None:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(fp8_dirs["fp8"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([IDS])).logits[0, :-1].float(), -1)
    got = _logprobs(str(fp8_dirs["fp8"]))
    # transformers decompresses to dense fp32 and runs its own attention: fp32 rounding only.
    assert (got - ref).abs().max() < 2e-3


@pytest.mark.slow
def test_hf_fp8_block_checkpoint_loads(fp8_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Hugging Face `fp8` (FineGrainedFP8): `weight_scale_inv` 128x128 blocks, quant_method fp8."""
    dst = tmp_path / "hf-fp8"
    shutil.copytree(fp8_dirs["fp8-block"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        save_file({k.replace(".weight_scale", ".weight_scale_inv") if k.endswith(".weight_scale") else k: v
                   for k, v in t.items()}, f)
    assert (_logprobs(str(dst)) - _logprobs(str(fp8_dirs["fp8-block"]))).abs().max() == 0


@pytest.mark.slow
def test_bad_fp8_checkpoints(fp8_dirs: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "bad"
    shutil.copytree(fp8_dirs["fp8"], dst)
    (f,) = dst.glob("*.safetensors")
    t = load_file(f)
    key = "model.layers.3.mlp.down_proj.weight_scale"
    t[key] = t[key][:-1]
    save_file(t, f)
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale has shape \(575, 1\), expected \(576, 1\)"):
        LLM(model=str(dst), log_stats=False, kv_cache_memory="64MiB", max_model_len=256)
    with pytest.raises(ValueError, match="compressed-tensors weights int4 are not supported yet"):
        Fp8Config.from_json({"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, "config.json")
    with pytest.raises(ValueError, match="weight_block_size=\\[64, 64\\] is not supported"):
        Fp8Config.from_json({"quant_method": "fp8", "weight_block_size": [64, 64]}, "config.json")
