"""compressed-tensors ``pack-quantized`` INT4/INT8 checkpoints written by the compressed-tensors
package itself (its PackedQuantizationCompressor and calculate_qparams, as llm-compressor
uses them) load in qpage and give the logits of the package's own decompression run as a dense
transformers model, and, for symmetric ones, of transformers loading the folder directly.
Both sides fp32 on the same weights (qpage's dequantized on request: this tests the reader), so
the bound is the architecture tests' 2e-4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.helpers import RunnerHarness, effective_weight

ct = pytest.importorskip("compressed_tensors")
IDS = [3, 17, 99, 140, 7, 250, 31, 64, 5, 201, 88, 12]


def _tiny_model() -> Any:
    """A 2-layer random Llama (GQA), weights spread so quantization has work to do."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _write(tmp: Path, bits: int, sym: bool, strategy: str) -> tuple[Path, Any]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _tiny_model()
    cfg = model.config
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=64 if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            state[name] = t.contiguous()
            continue
        g = 64 if strategy == "group" else t.shape[1]
        grouped = t.view(t.shape[0], -1, g)
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        parts = {"weight": t, "weight_scale": scale, "weight_zero_point": zp}
        prefix = name.removesuffix(".weight")
        for k, v in PackedQuantizationCompressor.compress(parts, scheme).items():
            state[f"{prefix}.{k}"] = v.contiguous()
    out = tmp / f"ct-w{bits}-{'sym' if sym else 'asym'}-{strategy}"
    out.mkdir()
    save_file(state, out / "model.safetensors")
    config = cfg.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=["lm_head"]).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config))
    return out, state


def _decompressed(state: dict[str, torch.Tensor], bits: int, sym: bool, strategy: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=64 if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = {k: v for k, v in state.items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    for k in state:
        if k.endswith(".weight_packed"):
            prefix = k.removesuffix(".weight_packed")
            parts = {n.rsplit(".", 1)[-1]: v for n, v in state.items() if n.startswith(prefix + ".weight_")}
            out[prefix + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    return out


@pytest.mark.parametrize("bits,sym,strategy", [(4, True, "group"), (4, False, "group"), (8, True, "channel")])
def test_peer_written_pack_quantized_loads(tmp_path: Path, bits: int, sym: bool, strategy: str) -> None:
    folder, state = _write(tmp_path, bits, sym, strategy)
    assert "model.layers.0.mlp.down_proj.weight_packed" in state
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in state) == (not sym)
    h = RunnerHarness(folder, num_blocks=16, max_len=256, dequantize_weights=True)
    ours = h.step([(h.request("r", IDS), len(IDS))])["r"]
    # Reference 1: the package's own decompress of every module, run as a dense transformers model.
    ref_model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in json.loads((folder / "config.json").read_text()).items()
        if k not in ("quantization_config", "architectures")})).eval()
    ref_model.load_state_dict(_decompressed(state, bits, sym, strategy), strict=True)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (ours - ref).abs().max() < 2e-4
    if sym:  # Reference 2: transformers loading the folder itself (its asymmetric load path
        # expects unpacked zero points in this version and refuses the package's own files).
        direct: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (direct(torch.tensor([IDS])).logits[0] - ours).abs().max() < 2e-4


def test_bad_pack_quantized(tmp_path: Path) -> None:
    from qpage.formats.detect import linear_config

    folder, _ = _write(tmp_path, 4, True, "group")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    with pytest.raises(ValueError, match="compressed-tensors int2 is not supported"):
        linear_config(qc, "config.json")
    from safetensors.torch import load_file

    t = load_file(folder / "model.safetensors")
    t["model.layers.1.self_attn.k_proj.weight_scale"] = t["model.layers.1.self_attn.k_proj.weight_scale"][:, :1].clone()
    save_file(t, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale has shape \(64, 1\), expected \(64, 2\)"):
        RunnerHarness(folder, num_blocks=16, max_len=256, dequantize_weights=True)


def _dense_folder(tmp: Path) -> Path:
    src = tmp / "src"
    _tiny_model().save_pretrained(src, safe_serialization=True)
    return src


@pytest.mark.slow
@pytest.mark.parametrize("name,sym,act_order", [("int4-rtn", False, False), ("int4-gptq", True, True),
                                                ("int8-rtn", True, False)])
def test_qpage_writes_pack_quantized(tmp_path: Path, name: str, sym: bool, act_order: bool) -> None:
    """qpage's compressed-tensors output holds the numbers of its GPTQ output (act-order with
    static groups, compressed-tensors' ``actorder: weight``): the same logits in qpage
    (exactly); the compressed-tensors package decompresses it to qpage's weights (to the fp16
    rounding of its arithmetic); transformers runs the symmetric files within 2e-4."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    src = _dense_folder(tmp_path)
    scheme = QuantScheme.parse(name, group_size=64 if name.startswith("int4") else None, sym=sym,
                               act_order=act_order, static_groups=act_order)
    calib = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    outs = {}
    for fmt in ("gptq", "compressed-tensors"):
        outs[fmt] = tmp_path / fmt
        quantize_checkpoint(src, outs[fmt], scheme, progress=False, fmt=fmt,
                            calib=calib if scheme.method == "gptq" else None)
    qc = json.loads((outs["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    from qpage.inspect_model import quant_info

    described = quant_info(qc, 128)  # what `qpage inspect` prints
    assert described["format"] == "compressed-tensors (pack-quantized)" and described["bits"] == scheme.bits
    assert described.get("actorder") == ("weight" if act_order else None)
    cfg_group = QuantizationConfig.model_validate(qc).config_groups["group_0"]  # the package parses it
    runs = {}
    for fmt, folder in outs.items():
        h = RunnerHarness(folder, num_blocks=16, max_len=256, dequantize_weights=True)
        runs[fmt] = (h.step([(h.request("r", IDS), len(IDS))])["r"],
                     effective_weight(h.model.layers[1].mlp.down_proj))
    assert torch.equal(runs["gptq"][0], runs["compressed-tensors"][0])
    state = {k: v for f in outs["compressed-tensors"].glob("*.safetensors") for k, v in load_file(f).items()}
    prefix = "model.layers.1.mlp.down_proj"
    parts = {k.rsplit(".", 1)[-1]: v for k, v in state.items() if k.startswith(prefix + ".weight_")}
    assert "weight_g_idx" not in parts and ("weight_zero_point" in parts) == (not sym)
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == ("weight" if act_order else None)
    theirs = PackedQuantizationCompressor.decompress(parts, cfg_group)["weight"].float()
    torch.testing.assert_close(theirs, runs["compressed-tensors"][1], rtol=2**-10, atol=1e-6)
    if sym:
        direct: Any = transformers.AutoModelForCausalLM.from_pretrained(outs["compressed-tensors"],
                                                                        dtype=torch.float32).eval()
        with torch.no_grad():
            lg = direct(torch.tensor([IDS])).logits[0]
        assert (lg - runs["compressed-tensors"][0]).abs().max() < 2e-4
