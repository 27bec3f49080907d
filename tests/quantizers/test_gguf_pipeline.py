"""``qpage quantize --format gguf``: files read back by an independent reader (the ``gguf``
package) hold the source's weights in llama.cpp's names and row order, within each format's
rounding; their tokenizer metadata rebuilds the source's tokenizer and chat template; qpage
runs them; the tensor types follow llama.cpp's file-type rules; a failed write leaves nothing.

Whether llama.cpp itself loads the files and scores them as qpage does is measured by
``benchmarks/gguf_quantize.py`` (llama-cpp-python takes too long to build for the suite)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader
from gguf.quants import dequantize

from qpage.formats.gguf_model import load_tokenizer, permute_rows
from qpage.formats.gguf_reader import GgufFile
from qpage.formats.gguf_write import FILE_TYPES, tensor_type
from qpage.quantizers import gguf_pipeline
from qpage.quantizers.ggml_blocks import Q4_K, Q5_0, Q6_K, Q8_0
from qpage.quantizers.gguf_pipeline import quantize_gguf

HF = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random two-layer Llama as wide as K-quants' super-blocks, with the default model's
    tokenizer and chat template."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, out / name)
    return out


def source_weights(folder: Path) -> dict[str, np.ndarray]:
    """The folder's tensors under llama.cpp's names, q/k rows in its rotary order."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    out = {}
    for name, t in load_file(str(next(folder.glob("*.safetensors")))).items():
        if name in HF:
            out[HF[name]] = t
            continue
        parts = name.split(".")
        if parts[-2] in ("q_proj", "k_proj"):
            t = permute_rows(t, cfg["num_attention_heads"] if parts[-2] == "q_proj" else cfg["num_key_value_heads"])
        kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "ffn_norm"}.get(parts[-2])
        out[f"blk.{parts[2]}.{kind}.weight" if kind else "output_norm.weight"] = t
    return out


def read_back(path: Path) -> dict[str, np.ndarray]:
    return {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
            for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("file_type, bound", [pytest.param("q8_0", 0.01, marks=pytest.mark.slow), ("q4_k_m", 0.12),
                                              pytest.param("q4_0", 0.15, marks=pytest.mark.slow)])
def test_weights_round_trip_from_a_folder(tiny: Path, tmp_path: Path, file_type: str, bound: float) -> None:
    """Every tensor comes back under its llama.cpp name, within about twice the relative RMS
    error of rounding Gaussian weights: a step is the block's largest magnitude (about 2.2
    sigma for 32 weights) over 127 (Q8_0) or 8 (Q4_0), and rounding costs step / sqrt(12):
    0.005 and 0.08; Q4_K's 16 levels span the range: about 0.085."""
    out = tmp_path / f"tiny.{file_type}.gguf"
    r = quantize_gguf(tiny, out, file_type, progress=False)
    assert r.linears == 2 * 7 + 2  # the decoder linears, the embedding and the output matrix
    want, got = source_weights(tiny), read_back(out)
    assert set(got) == set(want)
    for name, w in want.items():
        if w.ndim == 1:  # norms stay F32, exactly
            np.testing.assert_array_equal(got[name], w)
            continue
        rel = np.sqrt(((got[name] - w) ** 2).mean() / (w**2).mean())
        assert rel < bound, (name, rel)
    meta = GgufFile(out).metadata
    assert meta["general.file_type"] == FILE_TYPES[file_type][1]
    assert meta["llama.attention.head_count_kv"] == 2 and meta["llama.embedding_length"] == 256


def test_tokenizer_and_chat_template_travel(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    quantize_gguf(tiny, out, "q8_0", progress=False)
    f = GgufFile(out)
    assert f.metadata["tokenizer.ggml.pre"] == "gpt-2"  # llama.cpp's name for the folder's byte-level splitter
    built = load_tokenizer(f)
    ref = transformers.AutoTokenizer.from_pretrained(tiny)
    text = "Quantized KV caches, 1234 tokens/s — naïve café: <|im_start|>user\nhi<|im_end|>"
    assert built.encode(text) == ref.encode(text)
    msgs = [{"role": "user", "content": "What is a KV cache?"}]
    assert built.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert f.metadata["tokenizer.ggml.eos_token_id"] == ref.convert_tokens_to_ids(ref.eos_token)


def test_qpage_runs_the_file_like_its_weights(tiny: Path, tmp_path: Path) -> None:
    """The written file, run natively, gives the logits of transformers on the weights it
    holds (read back through the gguf package): mean KL within the packed kernels' 0.01."""
    from qpage import LLM

    out = tmp_path / "tiny.gguf"
    quantize_gguf(tiny, out, "q4_k_m", progress=False)
    back = read_back(out)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cfg = model.config
    inv = {v: k for k, v in HF.items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = next((g for g, h in inv.items() if h == name), None)
            if key is None:
                parts = name.split(".")
                kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                        "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}.get(parts[-2])
                key = f"blk.{parts[2]}.{kind}.weight" if kind else "output_norm.weight"
            w = back[key]
            if key.endswith(("attn_q.weight", "attn_k.weight")):  # back to Hugging Face's row order
                h = cfg.num_attention_heads if "attn_q" in key else cfg.num_key_value_heads
                n = w.shape[0]
                w = w[np.argsort(np.arange(n).reshape(h, 2, n // h // 2).swapaxes(1, 2).reshape(n))]
            p.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 2575, 314]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    llm = LLM(model=str(out), max_model_len=64, kv_cache_memory="16MiB", log_stats=False)
    from qpage.eval.perplexity import score_window

    got = score_window(llm.llm_engine, ids, 64)
    kl = (ref[:-1].exp() * (ref[:-1] - got)).sum(-1).mean()
    assert float(kl) < 0.01, float(kl)


def test_tensor_types_follow_llama_cpp_rules() -> None:
    """llama.cpp's Q4_K_M on a 30-layer model 576 wide (the default model's shape): the output
    (here the tied embedding) in Q6_K, falling back to Q8_0 for rows not whole super-blocks;
    value and down projections in Q6_K on the first and last eighth and every third layer
    between; K-quants on 576-wide rows fall back to Q5_0."""
    def t(name: str, shape: tuple[int, int], tied: bool = True) -> int:
        return tensor_type(name, shape, "q4_k_m", 30, tied)

    assert t("token_embd.weight", (49152, 576)) == Q8_0
    assert t("token_embd.weight", (49152, 512)) == Q6_K
    assert t("token_embd.weight", (49152, 512), tied=False) == Q4_K
    assert t("output.weight", (49152, 512), tied=False) == Q6_K
    assert [t(f"blk.{i}.ffn_down.weight", (576, 1536)) for i in (0, 2, 3, 4, 5, 8, 25, 26, 29)] == \
        [Q6_K, Q6_K, Q4_K, Q4_K, Q6_K, Q6_K, Q4_K, Q6_K, Q6_K]
    assert t("blk.3.attn_q.weight", (576, 576)) == Q5_0
    assert t("blk.0.attn_v.weight", (192, 576)) == Q8_0
    assert tensor_type("blk.0.attn_norm.weight", (576,), "q4_0", 30, True) == 0  # F32


@pytest.mark.slow
def test_requantizes_a_gguf_keeping_its_metadata(tmp_path: Path) -> None:
    from qpage.formats.gguf import default_gguf_path

    src = default_gguf_path()
    out = tmp_path / "smollm2.q8_0.gguf"
    quantize_gguf(src, out, "q8_0", progress=False)
    a, b = GgufFile(src, string_arrays=True), GgufFile(out, string_arrays=True)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "tokenizer.ggml.pre",
                "general.name", "llama.rope.freq_base"):
        assert a.metadata[key] == b.metadata[key], key
    assert b.metadata["general.file_type"] == 7
    src_w = read_back(src)
    for name, w in read_back(out).items():
        rel = np.sqrt(((w - src_w[name]) ** 2).mean() / (src_w[name] ** 2).mean())
        assert rel < 0.01, (name, rel)  # Q8_0 rounding: about 0.005 (see the round trip above)


def test_a_failed_write_leaves_nothing(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "broken.gguf"
    calls = []

    def failing(*args: object, **kwargs: object) -> np.ndarray:
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    real = gguf_pipeline.quantize_rows
    monkeypatch.setattr(gguf_pipeline, "quantize_rows", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        quantize_gguf(tiny, out, "q4_0", progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out.write_bytes(b"")
    with pytest.raises(FileExistsError):
        quantize_gguf(tiny, out, "q4_0", progress=False)
    with pytest.raises(ValueError, match=r"ending in \.gguf"):
        quantize_gguf(tiny, tmp_path / "folder", "q4_0", progress=False)
    with pytest.raises(ValueError, match="not written"):
        quantize_gguf(tiny, tmp_path / "x.gguf", "iq2_xs", progress=False)


@pytest.mark.slow
def test_cli_writes_gguf_and_refuses_mixed_formats(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    text = Path(__file__).resolve().parents[2] / "README.md"
    r = subprocess.run([sys.executable, "-m", "qpage", "quantize", str(tiny), str(out), "--scheme", "Q4_0",
                        "--eval-text", str(text), "--eval-windows", "1", "--seq-len", "64"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "GGUF Q4_0" in r.stdout and out.is_file()
    assert "perplexity on 1 x 64 tokens of README.md" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qpage", "inspect", str(out), "--no-load", "--json"],
                       capture_output=True, text=True)
    info = json.loads(r.stdout)
    assert info["quality"][0]["text"] == "README.md" and info["quality"][0]["perplexity"] > 1
    r = subprocess.run([sys.executable, "-m", "qpage", "quantize", str(tiny), str(tmp_path / "x"), "--scheme",
                        "q4_k_m", "--format", "gptq"], capture_output=True, text=True)
    assert r.returncode == 2 and "GGUF files take a llama.cpp file type" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qpage", "quantize", str(tiny), str(tmp_path / "y.gguf"), "--scheme",
                        "q4_0", "--sym"], capture_output=True, text=True)
    assert r.returncode == 2 and "GGUF file types fix their own grids" in r.stderr


@pytest.mark.parametrize("gptq", [False, True], ids=["imatrix", "gptq"])
def test_calibrated_files_lower_the_layer_error(tiny: Path, tmp_path: Path, gptq: bool) -> None:
    """Calibrated on windows of text, each decoder linear's output error on those windows'
    own inputs (first layer: the embedded tokens through the norm, read here with
    transformers) is below the uncalibrated file's; the imatrix file says so in llama.cpp's
    keys."""
    ids = [list(range(1000 + 97 * i, 1000 + 97 * i + 64)) for i in range(4)]
    plain, calibrated = tmp_path / "plain.gguf", tmp_path / "calibrated.gguf"
    quantize_gguf(tiny, plain, "q4_0", progress=False)
    quantize_gguf(tiny, calibrated, "q4_0", calib=ids, calib_folder=tiny, gptq=gptq, progress=False)
    meta = GgufFile(calibrated).metadata
    assert meta.get("quantize.imatrix.entries_count") == (None if gptq else 2 * 7)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model.model.embed_tokens(torch.tensor(ids))
        x = model.model.layers[0].input_layernorm(h).reshape(-1, 256)
    want = source_weights(tiny)["blk.0.attn_q.weight"]
    errs = [float((x @ torch.from_numpy(read_back(p)["blk.0.attn_q.weight"] - want).T).square().mean())
            for p in (plain, calibrated)]
    assert errs[1] < errs[0], errs
