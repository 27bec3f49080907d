"""Perplexity of Gemma 2 and Gemma 3 GGUF files in qpage and in llama.cpp on the same
wikitext-2 windows, as ``gguf_quality.py`` does for the default model: the same weights, so
the two must agree (the bar is 1%).

The models are random (seeded) with the default model's tokenizer: hidden 256 and MLP 512
(whole K-quant super-blocks), 6 layers (Gemma 3: five local, one global; Gemma 2: alternating),
a 128-token window under 512-token windows of text, soft caps of 4 and 8 on Gemma 2 so they
bend the scores. Each is written as F32 under llama.cpp's names (``tests/formats/test_gguf_gemma``)
and quantized by llama.cpp to Q8_0 and Q4_K_M.

Needs llama-cpp-python (quantizing and the peer's scores).

    python benchmarks/gguf_families.py [--windows 8] [--window 512] [--out F.json]
    python benchmarks/gguf_families.py --make-speed DIR   # Gemma 3 files for vs_llamacpp.py

``--make-speed`` writes a random Gemma 3 of Gemma-3-270M's shape (18 layers, hidden 640, one
KV head of 256, a 512-token window; the default model's 49,152-token vocabulary) in Q4_0 and
Q4_K_M, for ``benchmarks/vs_llamacpp.py --gguf``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import write_json
from gguf_quality import DATA, compare_files, llamacpp_quantize

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"Q8_0": 7, "Q4_K_M": 15}  # llama.cpp file types
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             query_pre_attn_scalar=64, sliding_window=128, max_position_embeddings=1024, num_hidden_layers=6)
CAPS = {"gemma2": dict(attn_logit_softcapping=4.0, final_logit_softcapping=8.0), "gemma3": {}}
SPEED_SHAPE = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   max_position_embeddings=32768)
SPEED_TYPES = {"Q4_0": 2, "Q4_K_M": 15}


def make_files(arch: str, out_dir: Path, tokenizer_dir: Path, shape: dict | None = None,
               types: dict[str, int] | None = None, keep_f32: bool = True) -> list[Path]:
    import gguf

    sys.path.insert(0, str(ROOT))
    from tests.formats.test_gguf_gemma import gemma, write_gemma_gguf

    folder = out_dir / arch
    folder.mkdir(parents=True, exist_ok=True)
    model = gemma(arch, folder, tokenizer_dir, **(shape or SHAPE), **CAPS[arch])
    f32 = write_gemma_gguf(arch, model, folder, folder / f"{arch}.F32.gguf", gguf.GGMLQuantizationType.F32)
    files = [f32] if keep_f32 else []
    files += llamacpp_quantize(f32, {folder / f"{arch}.{name}.gguf": t for name, t in (types or TYPES).items()})
    if not keep_f32:
        f32.unlink()
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_families.json"))
    p.add_argument("--make-speed", type=Path, default=None, help="write the Gemma 3 speed files into this folder")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from qpage.engine.tokenizers import load_tokenizer
    from qpage.eval.perplexity import token_windows
    from qpage.formats.gguf import default_model_dir

    tok_dir = default_model_dir()
    if args.make_speed:
        for f in make_files("gemma3", args.make_speed, tok_dir, SPEED_SHAPE, SPEED_TYPES, keep_f32=False):
            print(f)
        return
    tok = load_tokenizer(tok_dir)
    windows = token_windows(tok, Path(args.data), args.window, args.windows, max_chars=200 * args.window * args.windows)
    rows = compare_files(lambda tmp: (p for arch in CAPS for p in make_files(arch, tmp, tok_dir)), windows,
                         args.window, args.chunk)
    print(f"wrote {write_json(dict(windows=len(windows), window=args.window, chunk=args.chunk, rows=rows), args.out)}")


if __name__ == "__main__":
    main()
