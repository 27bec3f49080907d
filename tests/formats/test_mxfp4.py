"""gpt-oss's MXFP4 safetensors: a tiny random gpt-oss whose experts are written as the
published checkpoints store them (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``), against
transformers' own loader of that checkpoint (it dequantizes MXFP4 on CPU).

Dequantized, qpage's logits are within 2e-4 of transformers' (the same weights: summation order
only, the architecture tests' bound; measured 4.8e-7); packed (the experts on the C block,
int8 activations as every block format) within a mean KL of 0.01, the GGUF tests' bound
(measured 8e-7). ``benchmarks/mxfp4_checkpoint.py`` compares the packed path with llama.cpp's
conversion of a larger such checkpoint: equal logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qpage.formats.mxfp4 import ggml_rows
from qpage.inspect_model import quant_info
from tests.formats.mxfp4_writing import write_mxfp4
from tests.helpers import RunnerHarness
from tests.models.test_architectures import MOE_CASES, build


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    base = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    build(base / "float", *MOE_CASES["gpt-oss"])
    write_mxfp4(base / "float", base / "mxfp4")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        base / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    return base / "mxfp4", ref


@pytest.mark.parametrize("dequantize", [True, False])
def test_mxfp4_checkpoint_matches_transformers(mxfp4_model: tuple[Path, torch.nn.Module], dequantize: bool) -> None:
    path, ref = mxfp4_model
    h = RunnerHarness(path, num_blocks=32, dequantize_weights=dequantize)
    paths = {m.experts_path for m in h.model.modules() if hasattr(m, "experts_path")}
    assert paths == ({"torch"} if dequantize else {"cpu-native"})
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = h.step([(h.request("a", ids), len(ids))])["a"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    if dequantize:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        return
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).mean()) < 0.01


def test_ggml_rows_reorder_the_nibbles_only() -> None:
    """A block's 32 codes, given in pairs (2j, 2j + 1), come out as ggml's (j, j + 16)."""
    codes = torch.tensor(list(range(16)) + list(range(15, -1, -1)), dtype=torch.uint8)  # j + 16 holds 15 - j
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 1, 16)
    row = ggml_rows(packed.numpy(), torch.tensor([[131]], dtype=torch.uint8).numpy())[0]
    assert row[0] == 131
    assert [b & 15 for b in row[1:]] == list(range(16)) and [b >> 4 for b in row[1:]] == list(range(15, -1, -1))


def test_incomplete_or_odd_mxfp4_checkpoints_are_refused(mxfp4_model: tuple[Path, torch.nn.Module],
                                                         tmp_path: Path) -> None:
    path, _ = mxfp4_model
    assert quant_info(json.loads((path / "config.json").read_text())["quantization_config"], 64)["format"] == \
        "mxfp4 (gpt-oss)"
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.0\.down_proj has MXFP4 codes but no exponents"):
        RunnerHarness(broken, num_blocks=8)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["block_size"] = 16
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="block_size=16; MXFP4 checkpoints have blocks of 32"):
        RunnerHarness(broken, num_blocks=8)
