"""Perplexity of mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral) in qpage and in
llama.cpp on the same wikitext-2 windows, as ``gguf_families.py`` does for Gemma: the same
weights, so the two must agree (the bar is 1%).

The models are random (seeded) transformers models with the default model's tokenizer:
hidden 256, 8 experts of width 256 (whole K-quant super-blocks), top-2, 4 layers; Qwen2-MoE
with its shared expert (width 512); gpt-oss with its 128-token window on every other layer
(under 512-token windows of text), sinks, biases and YaRN. Each is converted by llama.cpp's own converter
(``llamacpp_convert.py``) to F32 and quantized by llama.cpp to Q8_0, Q4_K_M and MXFP4_MOE
(experts in MXFP4, the rest Q8_0).

    python benchmarks/gguf_moe.py [--windows 8] [--window 512] [--out F.json]
    python benchmarks/gguf_moe.py --make-speed DIR   # the files for vs_llamacpp.py

``--make-speed`` writes, in Q4_K_M: a random Qwen3-MoE of about 1B parameters with about 0.3B
active per token (``SPEED_MOE``), and a dense Qwen3 of about the same total size
(``SPEED_DENSE``); and a gpt-oss of the MoE's size in MXFP4_MOE (``SPEED_GPT_OSS``), for
``benchmarks/vs_llamacpp.py --gguf`` (``--only NAME`` for some of them).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from common import write_json
from gguf_quality import DATA, compare_files, llamacpp_quantize
from llamacpp_convert import convert

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"Q8_0": 7, "Q4_K_M": 15, "MXFP4_MOE": 38}  # llama.cpp file types (MXFP4_MOE: experts MXFP4, the rest Q8_0)
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
             max_position_embeddings=1024)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                        intermediate_size=512, norm_topk_prob=True)),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                        intermediate_size=512, shared_expert_intermediate_size=512,
                                        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                                      sliding_window=None)),
    "gpt-oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                                     sliding_window=128, rope_parameters={
                                         "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": 4096})),
}
SPEED_MOE = ("Qwen3MoeConfig", dict(hidden_size=1024, num_hidden_layers=18, num_attention_heads=16,
                                    num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=8,
                                    moe_intermediate_size=512, norm_topk_prob=True, max_position_embeddings=4096,
                                    tie_word_embeddings=True))
"""About 1.0B parameters, 0.32B active: 18 layers of 32 experts (1.6M parameters each), 8 per token."""
SPEED_DENSE = ("Qwen3Config", dict(hidden_size=1024, num_hidden_layers=18, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=64, intermediate_size=16384,
                                   max_position_embeddings=4096, tie_word_embeddings=True))
"""A dense Qwen3 of the MoE's shape with one MLP as wide as all its experts: the same total size."""
SPEED_GPT_OSS = ("GptOssConfig", dict(hidden_size=1024, num_hidden_layers=18, num_attention_heads=16,
                                      num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                      intermediate_size=512, sliding_window=128, max_position_embeddings=4096,
                                      tie_word_embeddings=False))
"""gpt-oss's layout at the MoE's size (a 128-token window on every other layer, sinks, biases,
YaRN, 4 experts of 32 per token), for its MXFP4_MOE file."""


def build(cls_name: str, config: dict[str, Any], folder: Path, tokenizer_dir: Path) -> Path:
    """A seeded random model (``tests.formats.gguf_writing.random_model``) saved with the default
    model's tokenizer files in ``folder``."""
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.formats.gguf_writing import random_model

    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(getattr(transformers, cls_name)(vocab_size=49152, **config), folder, tokenizer_dir)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_files(name: str, cls_name: str, config: dict[str, Any], out_dir: Path, tokenizer_dir: Path,
               types: dict[str, int], keep_f32: bool = True) -> list[Path]:
    folder = build(cls_name, config, out_dir / name, tokenizer_dir)
    f32 = convert(folder, out_dir / f"{name}.F32.gguf")
    files = [f32, *llamacpp_quantize(f32, {out_dir / f"{name}.{t}.gguf": ft for t, ft in types.items()})]
    if not keep_f32:  # the speed files only: the float copies are several GB
        f32.unlink()
        shutil.rmtree(folder)
        files = files[1:]
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_moe.json"))
    p.add_argument("--make-speed", type=Path, default=None, help="write the speed files into this folder")
    p.add_argument("--only", nargs="*", default=None, help="with --make-speed: these files only (by name)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from qpage.engine.tokenizers import load_tokenizer
    from qpage.eval.perplexity import token_windows
    from qpage.formats.gguf import default_model_dir

    tok_dir = default_model_dir()
    if args.make_speed:
        for name, (cls_name, config), types in (("qwen3moe-1b-a0.3b", SPEED_MOE, {"Q4_K_M": 15}),
                                                ("qwen3-dense-1b", SPEED_DENSE, {"Q4_K_M": 15}),
                                                ("gpt-oss-1b", SPEED_GPT_OSS, {"MXFP4_MOE": 38})):
            if args.only and name not in args.only:
                continue
            for f in make_files(name, cls_name, config, args.make_speed, tok_dir, types, keep_f32=False):
                print(f)
        return
    tok = load_tokenizer(tok_dir)
    windows = token_windows(tok, Path(args.data), args.window, args.windows, max_chars=200 * args.window * args.windows)
    rows = compare_files(lambda tmp: (p for name, (cls_name, extra) in FAMILIES.items()
                                      for p in make_files(name, cls_name, {**SHAPE, **extra}, tmp, tok_dir, TYPES)),
                         windows, args.window, args.chunk)
    print(f"wrote {write_json(dict(windows=len(windows), window=args.window, chunk=args.chunk, rows=rows), args.out)}")


if __name__ == "__main__":
    main()
