"""Checkpoints written by ``qpage quantize`` run packed on CPU: a calibrated GPTQ act-order and
an AWQ checkpoint of the default model go through the block kernels (``cpu-blocks``), act-order
as a gather of the activations' columns, and score like the same weights dequantized to fp32
(``dequantize_weights=True``).

Tolerance: mean KL of the next-token distributions over 160 prompt positions below 5e-3 and
the same top token at 95% of positions (measured: KL 1.7e-3 and 0.4e-3, top-1 agreement 1.0;
the int8 activation blocks are the difference, as for GGUF files). Quantization itself moves
these logits far more (KL 0.06-0.24 against the dense model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from qpage import LLM, SamplingParams
from qpage.eval.perplexity import kl_rows, score_window, token_windows
from qpage.formats.scheme import QuantScheme
from qpage.quantizers.pipeline import quantize_checkpoint

pytestmark = pytest.mark.slow

AWQ = QuantScheme.parse("int4-awq", group_size=128, sym=False)


@pytest.fixture(scope="module")
def checkpoints(default_model_dir: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory,
                gptq_act_order: Path) -> dict[str, Path]:
    calib = token_windows(tokenizer, Path(__file__).resolve().parents[2] / "README.md", 64, 2)
    awq = tmp_path_factory.mktemp("packed") / "awq"
    quantize_checkpoint(default_model_dir, awq, AWQ, progress=False, calib=calib)
    return {"gptq-act-order": gptq_act_order, "awq": awq}


def test_act_order_checkpoint_layout(checkpoints: dict[str, Path]) -> None:
    out = checkpoints["gptq-act-order"]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is True and cfg["meta"]["method"] == "gptq"
    t = load_file(str(next(out.glob("*.safetensors"))))
    g_idx = t["model.layers.0.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(576) // 128), "act-order should permute the groups"
    assert torch.equal(g_idx, t["model.layers.0.self_attn.k_proj.g_idx"]), "q/k/v share one input and one order"


@pytest.mark.parametrize("name", ["gptq-act-order", "awq"])
def test_runs_packed_like_the_dequantized_weights(checkpoints: dict[str, Path], tokenizer: Any, name: str) -> None:
    ids = tokenizer.encode("The history of the river town is told in its mills and bridges. " * 12)[:160]
    packed = LLM(model=str(checkpoints[name]), kv_cache_memory="16MiB", log_stats=False)
    eng = packed.llm_engine
    assert eng.kernel_paths()["quantized_linears"] == {"cpu-blocks": 120}
    qkv = eng.model.layers[0].self_attn.qkv_proj.kernel_mm
    assert (qkv.input_perm is not None) == (name == "gptq-act-order")
    ref = LLM(model=str(checkpoints[name]), kv_cache_memory="16MiB", log_stats=False, dequantize_weights=True)
    assert ref.llm_engine.kernel_paths()["quantized_linears"] == {"cpu-dequantized": 120}
    got, want = score_window(eng, ids, 64), score_window(ref.llm_engine, ids, 64)
    assert float(kl_rows(want, got).mean()) < 5e-3
    assert float((want.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.95
    # Generation runs on the packed path (EOS ignored: whether this checkpoint ends its answer
    # within 6 tokens depends on its calibration, not on the kernels).
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = packed.generate("The capital of France is", params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
