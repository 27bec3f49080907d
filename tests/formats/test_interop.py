"""GPTQ interop with the peer tools that install here (GPTQModel 7.7 and transformers with
its GPTQ backend, GPTQModel's torch kernel, in fp32):
- a checkpoint written by GPTQModel (act-order, so g_idx is permuted) runs in qpage;
- a checkpoint written by qpage (asymmetric, GPTQ v1 zero offsets) runs in transformers.
Both sides are compared on one linear's dequantized weight and on logits. GPTQModel's torch
kernel rounds dequantized weights to fp16, so weights agree to fp16 rounding (rtol 2^-10),
and logits (same argmax everywhere) to 5e-3 absolute on the 2-layer model (measured 1.7e-3,
logits ~3) and 0.1 on the 30-layer default model (measured 0.031, logits ~20), not to fp32.
qpage runs the weights dequantized in those two (``dequantize_weights``): they test the reader;
the block kernels are tested against that path in tests/quantizers/test_packed_cpu.py. The MoE
test runs both paths.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from qpage.formats.scheme import QuantScheme
from qpage.quantizers.pipeline import quantize_checkpoint
from tests.helpers import RunnerHarness, effective_weight

ROOT = Path(__file__).resolve().parents[2]
IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 77, 1000, 20000]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                                 reason="GPTQModel is not installed (scripts/test.sh installs it)")]


def qpage_run(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """qpage's logits for IDS and layer 0's down_proj weight as qpage dequantized it ([out, in])."""
    h = RunnerHarness(model_dir, num_blocks=16, max_len=256, dequantize_weights=True)
    logits = h.step([(h.request("r", IDS), len(IDS))])["r"]
    down = h.model.layers[0].mlp.down_proj
    return logits, effective_weight(down)


def peer_run(model_dir: Path, tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    out = tmp / "peer.safetensors"
    r = subprocess.run([sys.executable, "-m", "tests.formats.peer_logits", str(model_dir), str(out),
                        *map(str, IDS)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    t = load_file(out)
    return t["logits"], t["down_proj"]


def compare(ours: tuple[torch.Tensor, torch.Tensor], peer: tuple[torch.Tensor, torch.Tensor], atol: float) -> None:
    (lo, wo), (lp, wp) = ours, peer
    if wp.shape != wo.shape:
        wp = wp.t()
    torch.testing.assert_close(wo, wp, rtol=2**-10, atol=1e-6)
    assert (lo - lp).abs().max() < atol
    assert torch.equal(lo.argmax(-1), lp.argmax(-1))


def gptqmodel(src: Path, out: Path, *args: str) -> Path:
    """``src`` quantized by GPTQModel (``benchmarks/peers/gptqmodel_quantize.py``) on 64-token windows."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/peers/gptqmodel_quantize.py"), str(src), str(out),
                        "--seq-len", "64", *args], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random Llama with the default model's vocabulary and tokenizer (GPTQModel loads one)."""
    d = tmp_path_factory.mktemp("tiny") / "src"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, d / f)
    return d


def test_gptqmodel_checkpoint_runs_in_qpage(tiny: Path, tmp_path: Path) -> None:
    out = gptqmodel(tiny, tmp_path / "gptqmodel", "--random-windows", "8", "--group-size", "64", "--desc-act")
    g_idx = load_file(next(out.glob("*.safetensors")))["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx, torch.arange(256, dtype=g_idx.dtype) // 64)  # act-order: permuted groups
    compare(qpage_run(out), peer_run(out, tmp_path), atol=5e-3)


def test_qpage_checkpoint_runs_in_transformers(default_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "qpage-int4"
    quantize_checkpoint(default_model_dir, out, QuantScheme.parse("int4-rtn", group_size=128, sym=False),
                        progress=False)
    # 30 layers of the peer's fp16-rounded weights: measured 0.031 on logits of magnitude ~20.
    compare(qpage_run(out), peer_run(out, tmp_path), atol=0.1)


def test_gptqmodel_moe_checkpoint_runs_in_qpage(default_model_dir: Path, tmp_path: Path) -> None:
    """A Qwen3-MoE quantized by GPTQModel (per-expert GPTQ tensors, as the ecosystem's MoE
    checkpoints store them) runs in qpage on the C block. transformers 5 does not load such a
    checkpoint into its fused experts, so the references are the float model and qpage's own
    dequantized reading: each expert's weight within int4 rounding of the float one (relative
    RMS error 0.2; measured 0.13), the packed path's predictions within a mean KL of 5e-4 of the
    dequantized path's (int8 activations; measured 2.7e-5), and a mean KL to the float model
    below 0.05 (measured 0.013)."""
    src = tmp_path / "src"
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                                      moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(src, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, src / f)
    out = gptqmodel(src, tmp_path / "gptqmodel", "--random-windows", "16", "--group-size", "64")
    assert "model.layers.1.mlp.experts.5.down_proj.qweight" in load_file(next(out.glob("*.safetensors")))
    packed = RunnerHarness(out, num_blocks=16, max_len=256)
    assert {m.experts_path for m in packed.model.modules() if hasattr(m, "experts_path")} == {"cpu-native"}
    deq = RunnerHarness(out, num_blocks=16, max_len=256, dequantize_weights=True)
    float_w = load_file(src / "model.safetensors")
    for e in (0, 5):
        w = float_w[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        err = effective_weight(deq.model.layers[1].mlp.experts[e].down_proj) - w
        assert float(err.pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < 0.2
    got_p = packed.step([(packed.request("r", IDS), len(IDS))])["r"]
    got_d = deq.step([(deq.request("r", IDS), len(IDS))])["r"]
    packed_kl = torch.nn.functional.kl_div(got_p.log_softmax(-1), got_d.log_softmax(-1), log_target=True,
                                           reduction="none")
    assert float(packed_kl.sum(-1).mean()) < 5e-4
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
    kl = torch.nn.functional.kl_div(got_p.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).mean()) < 0.05
