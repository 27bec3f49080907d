"""llama.cpp's own Hugging Face -> GGUF converter, run on a local model folder.

The converter (``convert_hf_to_gguf.py`` and its ``gguf-py``) ships inside llama-cpp-python's
source distribution, which pip downloads (``$LLAMACPP_SRC`` may point at an unpacked
``llama.cpp`` tree instead). The models the benchmarks build carry the default model's
(SmolLM2) tokenizer, whose pre-tokenizer the converter knows as "smollm" but may not
recognise from a tokenizer rebuilt from GGUF metadata, so it is told. Llama-architecture
models (Mixtral) need the ``sentencepiece`` package for the converter to get past its
SentencePiece attempt.

    python benchmarks/llamacpp_convert.py MODEL_DIR OUT.gguf [--outtype f32]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
"""The llama-cpp-python release whose llama.cpp the benchmarks compare against."""
CACHE = Path(os.environ.get("QPAGE_CACHE", Path.home() / ".cache" / "qpage")) / "llama.cpp-src"
_RUN = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def llamacpp_source() -> Path:
    """The llama.cpp tree of llama-cpp-python ``VERSION`` (downloaded and unpacked once)."""
    if os.environ.get("LLAMACPP_SRC"):
        return Path(os.environ["LLAMACPP_SRC"])
    tree = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        Path(tmp, f"llama_cpp_python-{VERSION}").rename(CACHE / f"llama_cpp_python-{VERSION}")
    return tree


def convert(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``model_dir`` (config, safetensors, tokenizer) as a GGUF file at ``out``."""
    src = llamacpp_source()
    done = subprocess.run([sys.executable, "-c", _RUN, str(src), str(model_dir), "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {model_dir}:\n{done.stderr[-3000:]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="f32")
    args = p.parse_args()
    print(convert(args.model_dir, args.out, args.outtype))


if __name__ == "__main__":
    main()
