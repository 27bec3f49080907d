"""bitsandbytes 4-bit checkpoints (``formats.bnb``) against bitsandbytes and transformers.

Checkpoints are written by transformers + bitsandbytes from the default model (NF4 with
double-quantized absmax, FP4 without) and by ``qpage quantize --scheme nf4``. References:
``bitsandbytes.functional.dequantize_4bit`` for each weight (qpage's dequantization must equal
it exactly), and transformers' dense model on those dequantized weights in fp32 for logits
(transformers' own 4-bit CPU matmul does not run in exact fp32, so it is not the reference).

Tolerances: qpage's dequantized path agrees with the dense reference as a dense model does
(max |logit difference| 1e-3). The packed path (``cpu-blocks``) holds the codebook as int8
(NF4 times 112, FP4 times 120, rounded: a weight moves by up to 0.004 of its block's absmax)
and quantizes activations to int8 blocks: mean KL of the next-token distributions over the
prompt below 1.5e-2 for NF4 and 4e-2 for FP4, whose value 0.0052 has no close int8 form
(measured: 6.5e-3 and 1.8e-2; a Q4_1 GGUF of this model, 4.6e-3 on the same prompt).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from qpage.formats import bnb
from qpage.formats.detect import linear_config
from qpage.quantizers.nf4 import quantize_nf4
from tests.helpers import RunnerHarness

try:
    import bitsandbytes.functional as bnb_f
except ImportError:  # the peer is installed by scripts/install_peers.sh (the test command runs it)
    bnb_f = None
needs_bnb = pytest.mark.skipif(bnb_f is None, reason="bitsandbytes is not installed")

PROMPT = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers that "
          "changed physics. The first")
KINDS = {"nf4-nested": ("nf4", True), "fp4": ("fp4", False)}
KL_MAX = {"nf4": 1.5e-2, "fp4": 4e-2}


def _copy_tokenizer(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, out / f.name)


@pytest.fixture(scope="module")
def checkpoints(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = {}
    for name, (qt, nested) in KINDS.items():
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qt, bnb_4bit_use_double_quant=nested,
                                 bnb_4bit_compute_dtype=torch.float32)
        m = AutoModelForCausalLM.from_pretrained(default_model_dir, quantization_config=cfg, dtype=torch.float32,
                                                 device_map="cpu")
        out[name] = tmp_path_factory.mktemp("bnb") / name
        m.save_pretrained(out[name])
        _copy_tokenizer(default_model_dir, out[name])
    return out


def _linear_parts(path: Path, prefix: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        names = [k for k in f.keys() if k.startswith(prefix + ".")]  # noqa: SIM118 - safe_open has no __iter__
        return f.get_tensor(f"{prefix}.weight"), {k[len(prefix) + 1 :]: f.get_tensor(k) for k in names}


def bnb_dequantized(path: Path, prefix: str) -> torch.Tensor:
    """bitsandbytes' own dequantization of one linear in a checkpoint."""
    w, parts = _linear_parts(path, prefix)
    state = bnb_f.QuantState.from_dict({f"{prefix}.{k}": v for k, v in parts.items() if k != "weight"}, "cpu")
    return bnb_f.dequantize_4bit(w, state).float()


def dense_reference_logits(src: Path, path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 model with every quantized linear replaced by bitsandbytes'
    dequantization of it."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for name, mod in m.named_modules():
        if name.startswith("model.layers.") and isinstance(mod, torch.nn.Linear):
            mod.weight.data = bnb_dequantized(path, name)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


def qpage_logits(path: Path, ids: list[int], dequantize: bool) -> tuple[torch.Tensor, set[str], float]:
    """Logits, the linears' kernel paths, and their weights' bytes per weight."""
    h = RunnerHarness(path, dequantize_weights=dequantize)
    logits = h.step([(h.request("a", ids), len(ids))])["a"].float()
    linears = h.model.quant_linears()
    per_weight = sum(m.weight_bytes for m in linears) / sum(m.in_features * m.out_features for m in linears)
    return logits, {m.kernel_path for m in linears}, per_weight


def kl_mean(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean())


@pytest.mark.slow
@needs_bnb
@pytest.mark.parametrize("kind", KINDS)
def test_weights_equal_bitsandbytes_dequantization(checkpoints: dict[str, Path], kind: str) -> None:
    path = checkpoints[kind]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    cfg = linear_config(qc, "config.json")
    assert cfg == bnb.BnbConfig(*KINDS[kind])
    for prefix, shape in (("model.layers.0.self_attn.q_proj", (576, 576)), ("model.layers.5.mlp.down_proj",
                                                                            (576, 1536))):
        _, parts = _linear_parts(path, prefix)
        t = bnb.check_linear(prefix, parts, cfg, shape[1], shape[0], "f")
        assert isinstance(t, bnb.Bnb4Tensor)
        assert torch.equal(t.dequantize(), bnb_dequantized(path, prefix))


@pytest.mark.slow
@needs_bnb
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_runs_packed_and_dequantized(checkpoints: dict[str, Path], default_model_dir: Path,
                                                tokenizer: Any, kind: str) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    ref = dense_reference_logits(default_model_dir, checkpoints[kind], ids)
    exact, paths, _ = qpage_logits(checkpoints[kind], ids, dequantize=True)
    assert paths == {"cpu-dequantized"}
    assert float((exact - ref).abs().max()) < 1e-3
    packed, paths, per_weight = qpage_logits(checkpoints[kind], ids, dequantize=False)
    assert paths == {"cpu-blocks"}
    assert per_weight < 0.57  # 18 bytes per 32 weights (and rows padded to 16): no layer held in fp32
    assert kl_mean(ref, packed) < KL_MAX[KINDS[kind][0]]
    assert float((packed.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.slow
@needs_bnb
def test_qpage_nf4_checkpoint_reads_in_transformers(default_model_dir: Path, tmp_path: Path, tokenizer: Any) -> None:
    """``qpage quantize --scheme nf4`` writes what transformers + bitsandbytes load, holding
    the codes and absmax bitsandbytes' own quantizer gives the original weights."""
    from transformers import AutoModelForCausalLM

    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    out = tmp_path / "nf4"
    quantize_checkpoint(default_model_dir, out, QuantScheme.parse("nf4"), progress=False)
    orig = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    w = orig.model.layers[2].mlp.up_proj.weight.data
    q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(bnb_dequantized(out, "model.layers.2.mlp.up_proj"), bnb_f.dequantize_4bit(q, state))
    m = AutoModelForCausalLM.from_pretrained(out, device_map="cpu").eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        theirs = m(torch.tensor([ids])).logits[0].float()
    ours, _, _ = qpage_logits(out, ids, dequantize=True)
    # transformers' 4-bit CPU matmul is not exact fp32 (see the module note): held to the
    # distributions, not the logits.
    assert kl_mean(ours, theirs) < 2e-3


@needs_bnb
@pytest.mark.parametrize("shape", [(48, 128), (3, 100)])  # the second ends in a partial block
def test_nf4_quantizer_matches_bitsandbytes(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :64] = 0  # an all-zero block
    codes, absmax = quantize_nf4(w)
    q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
    flat = q.reshape(-1)
    assert torch.equal(absmax, state.absmax)
    assert torch.equal(torch.stack([flat >> 4, flat & 15], 1).reshape(-1)[: w.numel()], codes.reshape(-1))


def _parts(w: torch.Tensor, quant_map: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    t = bnb.pack_linear("p", *quantize_nf4(w))
    parts = {k[2:]: v for k, v in t.items()}
    if quant_map is not None:
        parts["weight.quant_map"] = torch.from_numpy(quant_map)
    return parts


def test_blocks_hold_nf4_and_fall_back_with_a_reason(caplog: pytest.LogCaptureFixture) -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    cfg = bnb.BnbConfig("nf4", False)
    t = bnb.check_linear("p", _parts(w), cfg, 128, 32, "f")
    assert isinstance(t, bnb.Bnb4Tensor) and t.ggml_type == bnb.KERNEL_TYPES["nf4"]
    codes, absmax = quantize_nf4(w)
    exact = torch.from_numpy(bnb.CODEBOOKS["nf4"])[codes.long()] * absmax.repeat_interleave(64).view(32, 128)
    assert torch.equal(t.dequantize(), exact)
    odd = bnb.CODEBOOKS["nf4"] * 0.9  # not bitsandbytes' codebook: no int8 form, held dense and exact
    with caplog.at_level("INFO", logger="qpage"):
        dense = bnb.check_linear("p", _parts(w, odd), cfg, 128, 32, "f")
    assert isinstance(dense, torch.Tensor) and "not bitsandbytes' NF4 codebook" in caplog.text
    assert torch.allclose(dense, exact * 0.9, rtol=1e-6, atol=0)
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    narrow = bnb.check_linear("p", _parts(w), cfg, 96, 16, "f")  # 64-weight blocks across rows: held dense
    codes, absmax = quantize_nf4(w)
    flat = torch.from_numpy(bnb.CODEBOOKS["nf4"])[codes.long()].reshape(-1) * absmax.repeat_interleave(64)[: 16 * 96]
    assert isinstance(narrow, torch.Tensor) and torch.equal(narrow, flat.view(16, 96))
    skipped = torch.randn(32, 128)  # a linear bitsandbytes left unquantized: its float weight alone
    assert torch.equal(bnb.check_linear("p", {"weight": skipped}, cfg, 128, 32, "f"), skipped)


@needs_bnb
def test_nested_absmax_decodes_as_bitsandbytes() -> None:
    """Double-quantized absmax (uint8 codes, a 256-value map and a scale per 256 blocks, plus
    the offset) as bitsandbytes writes and decodes it."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    parts = {"weight": q, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    t = bnb.check_linear("p", parts, bnb.BnbConfig("nf4", True), 512, 64, "f")
    assert isinstance(t, bnb.Bnb4Tensor)
    assert torch.equal(t.dequantize(), bnb_f.dequantize_4bit(q, state))


def test_bad_checkpoints_are_named() -> None:
    with pytest.raises(ValueError, match="8-bit"):
        linear_config({"quant_method": "bitsandbytes", "load_in_8bit": True}, "config.json")
    with pytest.raises(ValueError, match="bnb_4bit_quant_type='int4'"):
        linear_config({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "c")
    w = torch.randn(32, 128)
    cfg = bnb.BnbConfig("nf4", False)
    with pytest.raises(ValueError, match=r"p.weight.quant_state has shape \[32, 128\], expected \[32, 256\]"):
        bnb.check_linear("p", _parts(w), cfg, 256, 32, "f")
    parts = _parts(w)
    parts["weight.absmax"] = parts["weight.absmax"][:-1]
    with pytest.raises(ValueError, match=r"p\.weight\.absmax has 63 values, expected 64"):
        bnb.check_linear("p", parts, cfg, 128, 32, "f")
    parts = _parts(w)
    del parts["weight.quant_map"]
    with pytest.raises(ValueError, match=r"linear p lacks p\.weight\.quant_map"):
        bnb.check_linear("p", parts, cfg, 128, 32, "f")
    parts = _parts(w)
    parts["weight.absmax"] = parts["weight.absmax"] * float("nan")
    with pytest.raises(ValueError, match="not finite; the checkpoint is damaged"):
        bnb.check_linear("p", parts, cfg, 128, 32, "f")
    parts = _parts(w)
    parts["weight.quant_state.bitsandbytes__nf4"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    with pytest.raises(ValueError, match="not bitsandbytes' JSON"):
        bnb.check_linear("p", parts, cfg, 128, 32, "f")
    with pytest.raises(ValueError, match="quant_type='nf4', the config 'fp4'"):
        bnb.check_linear("p", {**_parts(w), "weight.quant_state.bitsandbytes__fp4":
                               _parts(w)["weight.quant_state.bitsandbytes__nf4"]}, bnb.BnbConfig("fp4", False),
                         128, 32, "f")
