"""Peak memory of ``qpage quantize`` (RTN, or GPTQ/AWQ with ``--calib``) on a 1.1B-parameter
Llama of random weights.

The model (TinyLlama-1.1B shapes: hidden 2048, 22 layers, intermediate 5632, vocab 32000,
fp32, ~4.4 GB) is generated tensor by tensor into several safetensors shards, so the
generator itself never holds the model. Then ``qpage quantize`` runs in a child process
under ``/usr/bin/time -v``; its maximum resident set size is compared with the model's fp32
size (the target: under 40%). Prints a table and writes JSON.

``--model default`` runs the same on the default model's fp32 folder instead, and
``--scheme`` takes several schemes, each in its own child: qpage's schemes, or llama.cpp
file types written as GGUF (``q4_k_m``; ``q4_k_m-imatrix`` with ``--calib``).

With ``--calib FILE`` (imatrix, GPTQ, AWQ, SignRound) the random model gets the default model's tokenizer and vocabulary
(49152, so 1.17B parameters) and calibrates on ``--samples`` windows of ``--seq-len`` tokens:
calibration reads one decoder layer at a time and spills each layer's results to disk.

    python benchmarks/quantize_memory.py [--scheme int4-rtn] [--shard-size 256MiB] [--keep DIR]
    python benchmarks/quantize_memory.py --scheme int4-gptq --calib ../shared/data/wikitext2/valid.txt
    python benchmarks/quantize_memory.py --model default --scheme int4-rtn int4-imatrix int4-gptq int4-awq \
        fp8 nf4 q4_0 q4_k_m q4_k_m-imatrix --calib ../shared/data/wikitext2/valid.txt --samples 32 --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from qpage.formats.gguf_write import FILE_TYPES  # noqa: E402 (the checkout's qpage, not an installed one)
from qpage.formats.scheme import CALIBRATED  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
          "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def make_model(folder: Path, shard_bytes: int, config: dict) -> int:
    """Write the random checkpoint; return its fp32 size in bytes."""
    import torch
    from safetensors.torch import save_file

    c = config
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * (c["hidden_size"] // 32)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                   (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    g = torch.Generator().manual_seed(0)
    buf: dict[str, torch.Tensor] = {}
    size, total, shard = 0, 0, 0
    for name, shape in shapes:
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        buf[name] = t
        size += t.numel() * 4
        total += t.numel() * 4
        if size >= shard_bytes:
            shard += 1
            save_file(buf, str(folder / f"model-{shard:05d}.safetensors"))
            buf, size = {}, 0
    if buf:
        shard += 1
        save_file(buf, str(folder / f"model-{shard:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total


def run_one(src: Path, out: Path, scheme: str, args: argparse.Namespace) -> dict:
    """``qpage quantize`` of ``src`` in a child under /usr/bin/time -v: peak RSS and seconds."""
    base = scheme.removesuffix("-imatrix")
    gguf = base in FILE_TYPES  # a llama.cpp file type: one .gguf file, calibrated when named "-imatrix"
    if gguf:
        out = out.with_suffix(".gguf")
        out.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "qpage.cli", "quantize", str(src), str(out),
           "--scheme", base if gguf else scheme, "--shard-size", args.shard_size]
    calibrated = scheme.split("-")[-1] in CALIBRATED
    if calibrated:
        if not args.calib:
            sys.exit(f"{scheme} needs --calib FILE")
        cmd += ["--calib", args.calib, "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    q_s = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"qpage quantize failed:\n{r.stderr[-3000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    if gguf:
        out_bytes = out.stat().st_size
        out.unlink()
    else:
        out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        shutil.rmtree(out)
    return dict(scheme=scheme, calib_windows=args.samples if calibrated else 0,
                seq_len=args.seq_len if calibrated else 0, peak_rss_bytes=int(m.group(1)) * 1024 if m else -1,
                output_bytes=out_bytes, quantize_seconds=q_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", nargs="+", default=["int4-rtn"])
    p.add_argument("--model", choices=("random-1.1b", "default"), default="random-1.1b",
                   help="the random 1.1B Llama, or the default model (its fp32 folder)")
    p.add_argument("--shard-size", default="256MiB", help="output shard size given to qpage quantize")
    p.add_argument("--keep", default=None, help="folder to generate the model in (kept); default a temp dir")
    p.add_argument("--calib", default=None, help="calibration text (imatrix/GPTQ/AWQ schemes)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantize_memory.json"))
    args = p.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="qpage-mem-"))
    config = dict(CONFIG)
    src = work / "random-1.1b"
    if args.calib:  # a tokenizer to calibrate with: the default model's, and its vocabulary
        config["vocab_size"] = 49152
        src = work / "random-1.1b-v49152"
    try:
        t = time.perf_counter()
        if args.model == "default":
            sys.path.insert(0, str(ROOT))
            from qpage.formats.gguf import default_model_dir

            src = default_model_dir()
            model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        elif not (src / "config.json").is_file():
            src.mkdir(parents=True, exist_ok=True)
            model_bytes = make_model(src, 1 << 30, config)
            if args.calib:
                from qpage.formats.gguf import default_model_dir

                for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                    if (default_model_dir() / f).is_file():
                        shutil.copy(default_model_dir() / f, src / f)
        else:
            model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        gen_s = time.perf_counter() - t
        rows = [run_one(src, work / "quantized", s, args) for s in args.scheme]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res = dict(model=args.model, params=model_bytes // 4, model_fp32_bytes=model_bytes, shard_size=args.shard_size,
               generate_seconds=gen_s, rows=rows)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"model: {args.model}, {res['params'] / 1e9:.2f}B parameters, {model_bytes / 1e9:.2f} GB fp32")
    print(f"{'scheme':<16} {'calib':>9} {'peak RSS GB':>12} {'of fp32':>8} {'out GB':>7} {'time s':>7}")
    for r in rows:
        calib = f"{r['calib_windows']}x{r['seq_len']}" if r["calib_windows"] else ""
        rss = r["peak_rss_bytes"]
        print(f"{r['scheme']:<16} {calib:>9} {rss / 1e9:>12.2f} {rss / model_bytes:>7.1%} "
              f"{r['output_bytes'] / 1e9:>7.2f} {r['quantize_seconds']:>7.0f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
