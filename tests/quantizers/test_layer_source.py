"""Bounded-memory calibration parts: ``LayerSource`` gives each decoder layer with the weights
the engine's loader gives it (read alone from the shards), and ``ResultStore`` returns what
was spilled, integers, scales, zeros and g_idx, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from qpage.layers.linear.factory import Linear
from qpage.layers.norms import RMSNorm
from qpage.models.loader import load_model, read_arch_config
from qpage.quantizers.layer_source import LayerSource, ResultStore
from tests.helpers import effective_weight


def test_layer_source_matches_the_loader(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src", safe_serialization=True,
                                                        max_shard_size="200KB")
    src = tmp_path / "src"
    assert len(list(src.glob("*.safetensors"))) > 1  # several shards
    whole = load_model(src, read_arch_config(src), torch.float32, torch.device("cpu"), 64)
    source = LayerSource(src, 64)
    assert source.model.embed_tokens.weight.numel() == 128  # vocabulary of 1: no embedding matrix
    ids = [[3, 5, 7], [250, 1]]
    for got, ref in zip(source.embed(ids), ids, strict=True):
        assert torch.equal(got, whole.embed_tokens.weight[torch.tensor(ref)])
    for i in (2, 0, 1):  # any order: each call refills the one layer
        layer = source.layer(i)
        want = dict(whole.layers[i].named_modules())
        linears = 0
        for name, mod in layer.named_modules():
            if isinstance(mod, Linear):  # what the forward multiplies by: the refilled weight
                assert torch.equal(effective_weight(mod), effective_weight(want[name])), (i, name)
                linears += 1
            elif isinstance(mod, RMSNorm):
                assert torch.equal(mod.weight, want[name].weight), (i, name)
        assert linears == 4  # qkv, o, gate_up, down


def test_result_store_round_trip(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "spill")
    g = torch.Generator().manual_seed(0)
    res = {}
    for li in range(2):
        for proj in ("self_attn.q_proj", "mlp.down_proj"):
            q = torch.randint(0, 16, (64, 32), generator=g, dtype=torch.int32)
            g_idx = (torch.randperm(64, generator=g) // 32).int() if proj == "mlp.down_proj" else None
            res[f"model.layers.{li}.{proj}"] = (q, torch.rand(2, 32, generator=g),
                                                torch.randint(0, 16, (2, 32), generator=g, dtype=torch.int32), g_idx)
        store.put_layer(li, {k: v for k, v in res.items() if k.startswith(f"model.layers.{li}.")})
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == ["layer-00000.safetensors",
                                                                     "layer-00001.safetensors"]
    for prefix in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        got, want = store[prefix], res[prefix]
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
