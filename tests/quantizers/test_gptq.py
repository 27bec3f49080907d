"""GPTQ against RTN on correlated inputs, the act-order grouping, and a calibrated checkpoint
of the default model that loads and runs in the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from qpage import LLM, SamplingParams
from qpage.eval.perplexity import token_windows
from qpage.quantizers.gptq import gptq_quantize
from qpage.quantizers.pipeline import quantize_checkpoint
from qpage.quantizers.rtn import dequantize_rtn, quantize_rtn
from qpage.quantizers.scheme import QuantScheme


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 256, generator=g)
    mix = torch.randn(256, 256, generator=g) * 0.3 + torch.eye(256)
    x = (torch.randn(2048, 256, generator=g) @ mix) * torch.linspace(0.2, 3, 256)
    return w, x, 2 * x.T @ x / x.shape[0]


def _dequant(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g_idx: torch.Tensor | None, group: int
             ) -> torch.Tensor:
    grp = g_idx.long() if g_idx is not None else torch.arange(q.shape[0]) // group
    return ((q - z[grp]).float() * s[grp]).t()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output(sym: bool, act_order: bool) -> None:
    w, x, h = _problem()
    ref = x @ w.T

    def err(wq: torch.Tensor) -> float:
        return float((x @ wq.T - ref).norm() / ref.norm())

    rtn = err(dequantize_rtn(*quantize_rtn(w, 4, 64, sym), 64))
    q, s, z, g_idx = gptq_quantize(w, h, 4, 64, sym, act_order=act_order)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and int(z.min()) >= 1
    assert err(_dequant(q, s, z, g_idx, 64)) < 0.9 * rtn
    if act_order:
        assert g_idx is not None and torch.bincount(g_idx.long()).tolist() == [64] * 4
    else:
        assert g_idx is None


@pytest.mark.slow
def test_gptq_checkpoint_with_act_order_runs(default_model_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    text = Path(__file__).resolve().parents[2] / "README.md"
    calib = token_windows(tokenizer, text, 64, 2)
    out = tmp_path / "gptq"
    quantize_checkpoint(default_model_dir, out, QuantScheme(4, 128, True, method="gptq", act_order=True),
                        progress=False, calib=calib)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is True and cfg["meta"]["method"] == "gptq"
    t = load_file(str(next(out.glob("*.safetensors"))))
    g_idx = t["model.layers.0.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(576) // 128), "act-order should permute the groups"
    assert torch.equal(g_idx, t["model.layers.0.self_attn.k_proj.g_idx"]), "q/k/v share one input and one order"
    llm = LLM(model=str(out), kv_cache_memory="8MiB", log_stats=False)
    text_out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0]
    assert len(text_out.token_ids) == 6
