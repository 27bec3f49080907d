"""Perplexity of GGUF files in qpage and in llama.cpp on the same wikitext-2 windows: the same
weights, so the two must agree (within 0.5%); what differs is each engine's arithmetic
(both quantize activations to int8 blocks for their block-format matmuls).

Files: the default model's own Q4_1, and the same weights (dequantized once to F32) quantized
by llama.cpp to Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K and IQ4_XS (written to ``--files``, reused
when present).
qpage scores each window teacher-forced in chunks of ``--chunk`` tokens (``qpage eval``'s
path); llama.cpp runs in its own process with an f16 cache and the same micro-batches
(``peers/llamacpp_kv_cache.py``'s worker).

Needs llama-cpp-python (quantizing and the peer's scores).

    python benchmarks/gguf_quality.py [--windows 16] [--window 512] [--files DIR] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from common import write_json

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"
PEER = Path(__file__).resolve().parent / "peers" / "llamacpp_kv_cache.py"
TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_XS": 30}  # llama.cpp file types


def make_files(src: Path, out_dir: Path) -> list[Path]:
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    want = {name: out_dir / f"{src.stem.split('.')[0]}.{name}.gguf" for name in TYPES}
    if all(p.is_file() for p in want.values()):
        return [src, *want.values()]
    reader = gguf.GGUFReader(str(src))
    f32 = out_dir / "f32.gguf"
    w = gguf.GGUFWriter(str(f32), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llamacpp_quantize(f32, {want[name]: ftype for name, ftype in TYPES.items()})
    f32.unlink()
    return [src, *want.values()]


def llamacpp_quantize(f32: Path, outputs: dict[Path, int]) -> list[Path]:
    """``f32`` quantized by llama.cpp's ``llama_model_quantize`` to each output path's file type
    (``llama_ftype``: 7 Q8_0, 15 Q4_K_M, 38 MXFP4_MOE, ...), on 2 threads."""
    import llama_cpp

    for dst, ftype in outputs.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, 2
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(dst).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {f32.name} to {dst.name}")
    return list(outputs)


def compare_files(files: Callable[[Path], Iterable[Path]], windows: list[list[int]], window: int, chunk: int
                  ) -> list[dict]:
    """Score each file ``files(tmp)`` makes (in a temporary folder) in both engines on the same
    windows (``compare_row``), printing a row per file as it goes."""
    rows = []
    print(f"{'file':<36} {'qpage':>11} {'llama.cpp':>11} {'diff %':>7} {'KL':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        wf = Path(tmp) / "windows.json"
        wf.write_text(json.dumps([list(map(int, w)) for w in windows]))
        for path in files(Path(tmp)):
            row = compare_row(path, windows, wf, window, chunk, Path(tmp))
            rows.append(row)
            print(f"{path.name:<36} {row['qpage']:11.4f} {row['llamacpp']:11.4f} {row['diff_pct']:+7.3f} "
                  f"{row['kl_vs_llamacpp']:9.2e}", flush=True)
    return rows


def qpage_logprobs(path: Path, windows: list[list[int]], chunk: int) -> np.ndarray:
    sys.path.insert(0, str(ROOT))
    from qpage import LLM
    from qpage.eval.perplexity import score_window

    eng = LLM(model=str(path), kv_cache_memory=256 << 20, max_model_len=len(windows[0]), log_stats=False).llm_engine
    return np.stack([score_window(eng, w, chunk).numpy() for w in windows])


def llamacpp_logprobs(path: Path, windows_file: Path, window: int, chunk: int, tmp: Path) -> np.ndarray:
    save = tmp / "lp.npy"
    subprocess.run([sys.executable, str(PEER), "--worker", "--gguf", str(path), "--window", str(window),
                    "--chunk", str(chunk), "--type-k", "1", "--type-v", "1", "--windows-file", str(windows_file),
                    "--save", str(save)], check=True)
    return np.load(save)


def compare_row(path: Path, windows: list[list[int]], windows_file: Path, window: int, chunk: int,
                tmp: Path) -> dict:
    """One file scored by both engines on the same windows: perplexities, their difference
    and the mean KL of qpage's predictions from llama.cpp's."""
    targets = np.array([w[1:] for w in windows])
    ours = qpage_logprobs(path, windows, chunk)
    peer = llamacpp_logprobs(path, windows_file, window, chunk, tmp)
    nll = [float(-np.take_along_axis(lp, targets[..., None], -1).mean()) for lp in (ours, peer)]
    kl = float((np.exp(peer) * (peer - ours)).sum(-1).mean())
    return dict(file=path.name, qpage=math.exp(nll[0]), llamacpp=math.exp(nll[1]),
                diff_pct=100 * (math.exp(nll[0] - nll[1]) - 1), kl_vs_llamacpp=kl)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--files", type=Path, default=ROOT / "benchmarks" / "results" / "gguf_files")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gguf_quality.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from qpage.engine.tokenizers import load_tokenizer
    from qpage.eval.perplexity import token_windows
    from qpage.formats.gguf import default_gguf_path

    src = default_gguf_path()
    files = make_files(src, args.files)
    tok = load_tokenizer(src)
    windows = token_windows(tok, Path(args.data), args.window, args.windows, max_chars=200 * args.window * args.windows)
    rows = compare_files(lambda tmp: files, windows, args.window, args.chunk)
    print(f"wrote {write_json(dict(windows=len(windows), window=args.window, chunk=args.chunk, rows=rows), args.out)}")


if __name__ == "__main__":
    main()
