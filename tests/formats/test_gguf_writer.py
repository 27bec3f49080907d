"""A GGUF written by the `gguf` package's own writer (GGUFWriter + gguf.quants.quantize), with
Q4_0, Q4_1 and Q8_0 tensors, loads in qpage. Converted to a safetensors folder (what the
quantizers read), its weights equal the `gguf` package's dequantization (with llama.cpp's q/k
row permutation undone, computed here independently) and qpage's logits match transformers
run on those weights to 2e-4. Run natively (its blocks kept packed), the logits are held to a
mean KL of 0.01 against the same reference: the kernels quantize activations to int8 blocks
(tests/formats/test_gguf_native.py says why that bound).

The `gguf` package cannot write K-quants (its quantize raises NotImplementedError for
Q4_K/Q5_K/Q6_K), so K-quant files are not covered by this test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from qpage.formats.gguf import default_gguf_path
from tests.helpers import RunnerHarness

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

gguf = pytest.importorskip("gguf")
QTYPES = {"ffn_": "Q4_0", "attn_": "Q4_1", "token_embd": "Q8_0"}
IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 2575, 314]


def qtype_for(name: str) -> str | None:
    if name.endswith("norm.weight"):
        return None
    return next(q for prefix, q in QTYPES.items() if prefix in name)


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The default model re-quantized tensor by tensor into a new GGUF; also returns what each
    tensor dequantizes to."""
    src = gguf.GGUFReader(str(default_gguf_path()))
    path = tmp_path_factory.mktemp("gguf") / "smollm2-mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    values: dict[str, np.ndarray] = {}
    for t in src.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        q = qtype_for(t.name)
        if q is None:
            w.add_tensor(t.name, x)
            values[t.name] = x
        else:
            qt = getattr(gguf.GGMLQuantizationType, q)
            data = gguf.quants.quantize(x, qt)
            w.add_tensor(t.name, data, raw_dtype=qt)
            values[t.name] = gguf.quants.dequantize(data, qt).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, values


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of q/k."""
    out, inp = x.shape
    return x.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def expected_state(values: dict[str, np.ndarray], cfg: dict) -> dict[str, torch.Tensor]:
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    out = {"model.embed_tokens.weight": values["token_embd.weight"], "model.norm.weight": values["output_norm.weight"]}
    for name, x in values.items():
        parts = name.split(".")
        if parts[0] != "blk":
            continue
        kind = parts[2]
        if kind == "attn_q":
            x = _unpermute(x, h)
        elif kind == "attn_k":
            x = _unpermute(x, kv)
        out[f"model.layers.{parts[1]}.{names[kind]}.weight"] = x
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def test_gguf_package_file_loads_in_qpage(rewritten: tuple[Path, dict[str, np.ndarray]],
                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from qpage.models.loader import resolve_hf_folder

    path, values = rewritten
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"Q4_0", "Q4_1", "Q8_0"} <= kinds
    monkeypatch.setenv("QPAGE_CACHE", str(tmp_path / "cache"))
    folder = resolve_hf_folder(str(path))  # what `qpage quantize x.gguf` reads
    cfg = json.loads((folder / "config.json").read_text())
    got = load_file(folder / "model.safetensors")
    want = expected_state(values, cfg)
    assert set(want) <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k], v), k  # exact: both are the gguf package's dequantization
    # Logits: qpage on the GGUF against transformers on the independently mapped weights.
    h = RunnerHarness(folder, num_blocks=16, max_len=256)
    ours = h.step([(h.request("r", IDS), len(IDS))])["r"]
    ref_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})).eval()
    missing, unexpected = ref_model.load_state_dict(want, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), missing
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0]
    assert (ours - ref).abs().max() < 2e-4
    # Natively, as LLM(model="x.gguf") runs it.
    h = RunnerHarness(path, num_blocks=16, max_len=256)
    assert {m.kernel_path for m in h.model.modules() if hasattr(m, "kernel_path")} == {"cpu-blocks"}
    native = h.step([(h.request("r", IDS), len(IDS))])["r"].double()
    p_ref, p_ours = torch.log_softmax(ref.double(), -1), torch.log_softmax(native, -1)
    assert (p_ref.exp() * (p_ref - p_ours)).sum(-1).mean() < 0.01
