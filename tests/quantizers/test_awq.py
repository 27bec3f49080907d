"""AWQ: the scale search, the folded and quantized checkpoint (AWQ GEMM format) read back,
and the format's reader. AutoAWQ needs CUDA to quantize, so no peer-written AWQ checkpoint
is made here; the reader is checked against tensors packed from the documented layout
(nibble order 0,2,4,6,1,3,5,7, pinned by tests/kernels/test_quant_matmul.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qpage.formats.awq import AwqConfig, check_linear
from qpage.formats.gptq import GptqConfig
from qpage.formats.gptq import check_linear as gptq_check
from qpage.formats.gptq import pack_linear as gptq_pack
from qpage.formats.scheme import QuantScheme
from qpage.kernels.packing import dequantize_ref, pack_cols, unpack_cols
from qpage.quantizers.awq import fake_quant, output_error, search_scale
from qpage.quantizers.pipeline import choose_format, quantize_checkpoint
from qpage.quantizers.rtn import quantize_rtn
from tests.helpers import RunnerHarness

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama without GQA (so o_proj is scaled too) with outlier input channels, the case
    AWQ is for: a few hidden channels carry 20x larger activations."""
    d = tmp_path_factory.mktemp("tiny") / "src"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(128)[:6]] *= 20
    model.save_pretrained(d, safe_serialization=True)
    return d


def windows(n: int = 6, length: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def logits(model_dir: Path, ids: list[int], dequantize_weights: bool = False) -> torch.Tensor:
    h = RunnerHarness(model_dir, num_blocks=16, max_len=256, dequantize_weights=dequantize_weights)
    return h.step([(h.request("r", ids), len(ids))])["r"]


def test_scale_search_never_loses_to_rtn() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 30  # outlier channels
    w = torch.randn(64, 128, generator=g)
    h = x.t() @ x / 512
    s, ratio, rel = search_scale(h, x.abs().mean(0), w, 4, 64, sym=False)
    assert rel < 0.8  # activation-aware scales cut the output error markedly here
    err = float(output_error(fake_quant(w * s, 4, 64, False) / s - w, h).sum())
    direct = float(((x / s) @ fake_quant(w * s, 4, 64, False).t() - x @ w.t()).pow(2).mean(0).sum())
    assert err == pytest.approx(direct, rel=1e-3)  # d H d^T is the mean squared output error
    assert ratio >= 0


def test_awq_checkpoint_reads_back_and_beats_rtn(tiny: Path, tmp_path: Path) -> None:
    awq = tmp_path / "awq"
    quantize_checkpoint(tiny, awq, QuantScheme.parse("int4-awq", group_size=64, sym=False), progress=False,
                        calib=windows())
    qc = json.loads((awq / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == "gemm" and qc["group_size"] == 64
    tensors = load_file(next(awq.glob("*.safetensors")))
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (256, 128 // 8)
    # The same model, dequantized by the documented formula into a dense folder.
    dense = tmp_path / "dense"
    dense.mkdir()
    cfg = json.loads((awq / "config.json").read_text())
    del cfg["quantization_config"]
    (dense / "config.json").write_text(json.dumps(cfg))
    out = {}
    for k, v in tensors.items():
        if k.endswith(".qweight"):
            p = k.removesuffix(".qweight")
            q = unpack_cols(v, 4, v.shape[1] * 8, awq=True)
            z = unpack_cols(tensors[p + ".qzeros"], 4, v.shape[1] * 8, awq=True)
            grp = torch.arange(q.shape[0]) // 64
            out[p + ".weight"] = ((q - z[grp]).float() * tensors[p + ".scales"].float()[grp]).t().contiguous()
        elif not k.endswith((".qzeros", ".scales")):
            out[k] = v
    save_file(out, dense / "model.safetensors")
    ids = windows(1, 48)[0]
    got, ref = logits(awq, ids, dequantize_weights=True), logits(dense, ids)
    assert (got - ref).abs().max() < 1e-4  # the reader: the same weights exactly
    # Quality: closer to the float model than RTN with the same grid.
    rtn = tmp_path / "rtn"
    quantize_checkpoint(tiny, rtn, QuantScheme.parse("int4-rtn", group_size=64, sym=False), progress=False)
    base = logits(tiny, ids)
    err_awq, err_rtn = (logits(awq, ids) - base).pow(2).mean(), (logits(rtn, ids) - base).pow(2).mean()
    assert err_awq < 0.8 * err_rtn, (float(err_awq), float(err_rtn))


def test_awq_reader_matches_gptq_reader_for_the_same_weights() -> None:
    w = torch.randn(64, 192)
    q, s, z = quantize_rtn(w, 4, 64, sym=False)
    awq_parts = {"qweight": pack_cols(q, 4, awq=True), "qzeros": pack_cols(z, 4, awq=True), "scales": s.half()}
    a = check_linear("p", awq_parts, AwqConfig(4, 64), 192, 64, "f")
    gptq_parts = {k.split(".")[-1]: v for k, v in gptq_pack("p", q, s, z, 4, 64).items()}
    b = gptq_check("p", gptq_parts, GptqConfig(4, 64, False, False, True), 192, 64, "f")
    deq = [dequantize_ref(t["qweight"], t["scales"], t["qzeros"], t["g_idx"], bits=4, group_size=64, in_features=192)
           for t in (a, b)]
    assert torch.equal(deq[0], deq[1])
    awq_parts["qweight"] = awq_parts["qweight"][:-1]
    with pytest.raises(ValueError, match=r"p\.qweight has shape \(191, 8\), expected \(192, 8\)"):
        check_linear("p", awq_parts, AwqConfig(4, 64), 192, 64, "f")
    with pytest.raises(ValueError, match="AWQ bits=8 is not supported"):
        AwqConfig.from_json({"quant_method": "awq", "bits": 8}, "config.json")


def test_format_choice() -> None:
    awq = QuantScheme.parse("int4-awq", group_size=128)
    shapes = {"model.layers.0.mlp.up_proj": [1536, 576]}
    assert choose_format(awq, "auto", shapes) == "gptq"  # 576 % 128: AWQ GEMM cannot hold it
    assert choose_format(QuantScheme.parse("int4-awq", group_size=64), "auto", shapes) == "awq"
    with pytest.raises(ValueError, match="in_features=576 is not a multiple of group size 128"):
        choose_format(awq, "awq", shapes)
    assert choose_format(QuantScheme.parse("fp8"), "auto", shapes) == "compressed-tensors"
    with pytest.raises(ValueError, match="FP8 weights are written as compressed-tensors"):
        choose_format(QuantScheme.parse("fp8"), "gptq", shapes)
