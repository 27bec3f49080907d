"""Sign-gradient rounding (``int4-signround``): its differentiable layer computes the engine's
layer (Llama, Qwen2's biases, Qwen3's QK-norm), each layer's training lowers the output error
below the imatrix grid it starts from, and the checkpoint reads back as the integers it learnt
and runs closer to the unquantized model than imatrix's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from qpage.formats.scheme import QuantScheme
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan
from qpage.quantizers.layer_source import LayerSource, ResultStore
from qpage.quantizers.pipeline import quantize_checkpoint
from qpage.quantizers.signround import LayerParams, Rounding, layer_forward, signround_calibrate
from tests.helpers import RunnerHarness

BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny(folder: Path, kind: str) -> Path:
    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q, k, v
        model: Any = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE))
    elif kind == "qwen3":  # QK-norm
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, head_dim=32))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # non-trivial norms and biases
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def windows(n: int = 6, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_layer_forward_is_the_engines_layer(kind: str, tmp_path: Path) -> None:
    source = LayerSource(tiny(tmp_path / kind, kind), 64)
    model, c = source.model, source.arch
    layer = source.layer(1)
    h = source.embed(windows(1))[0] * 30  # hidden states of a realistic size
    t = h.shape[0]
    nb = -(-t // 16)
    backend = TorchPagedAttention(KVCacheSpec(torch.float32))
    cache = make_layer_kv(KVCacheSpec(torch.float32), nb, c.num_kv_heads, c.head_dim, torch.device("cpu"))
    pos = torch.arange(t)
    meta = backend.build_metadata(AttentionBatch(pos, prefills=[SeqSpan(0, t, t, list(range(nb)))]), pos.device)
    cos, sin = model.rotary.lookup(pos)
    with torch.inference_mode():
        ref = layer.forward(h, cos, sin, cache, meta, backend)
    got = layer_forward(h, LayerParams.of(layer), cos, sin, c)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_rounding_result_is_what_it_trains() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 80, generator=g)  # 80 inputs: a partial last group of 32
    r = Rounding(w, torch.rand(80, generator=g) + 0.1, bits=4, g=32, sym=False)
    with torch.no_grad():
        r.v.uniform_(-0.5, 0.5, generator=g)
        r.f.uniform_(0.8, 1.2, generator=g)
    (q, s, z), deq = r.result()
    assert q.shape == (80, 24) and s.shape == (3, 24) and z.shape == (3, 24) and int(q.max()) <= 15
    assert torch.equal(s, s.half().float())  # scales as fp16 holds them
    grp = torch.arange(80) // 32
    assert torch.allclose(deq, ((q.int() - z[grp]).float() * s[grp]).t(), rtol=0, atol=1e-6)
    # Rounding the scales to fp16 moves a weight by |q - z| 2^-11 s, and a code by one where that
    # crosses a rounding boundary: on average the result is the trained weight.
    assert float((deq - r.weight().detach()).abs().mean()) <= 0.02 * float(s.mean())


def test_training_lowers_each_layers_error(tmp_path: Path) -> None:
    src = tiny(tmp_path / "llama", "llama")
    losses: list[tuple[float, float]] = []
    store = signround_calibrate(src, QuantScheme.parse("int4-signround", group_size=32), windows(), ResultStore(
        tmp_path / "spill"), losses=losses)
    assert len(losses) == 2
    for first, kept in losses:
        assert kept < 0.8 * first, losses  # the imatrix grid is the start; training must improve on it
    q, s, z, g_idx = store["model.layers.1.self_attn.k_proj"]
    assert q.shape == (128, 64) and s.shape == z.shape == (4, 64) and g_idx is None


@pytest.mark.slow
def test_checkpoint_runs_closer_than_imatrix(tmp_path: Path) -> None:
    src = tiny(tmp_path / "src", "llama")
    calib, ids = windows(8, 64), windows(1, 64)[0]
    h0 = RunnerHarness(src)
    ref = torch.log_softmax(h0.step([(h0.request("r", ids), len(ids))])["r"], -1)

    def kl(folder: Path) -> float:
        h = RunnerHarness(folder)
        lp = torch.log_softmax(h.step([(h.request("r", ids), len(ids))])["r"], -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    out = {}
    for method in ("imatrix", "signround"):
        out[method] = tmp_path / method
        quantize_checkpoint(src, out[method], QuantScheme.parse(f"int4-{method}", group_size=32), progress=False,
                            calib=calib)
    qc = json.loads((out["signround"] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["meta"]["method"] == "signround"
    assert kl(out["signround"]) < kl(out["imatrix"])
