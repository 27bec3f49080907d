"""Round-to-nearest speed: ``qpage quantize --scheme int4-rtn --no-sym`` against llama.cpp's
``llama_model_quantize`` (Q4_0 and Q4_1, through llama-cpp-python) on the same weights.

The weights: the random 1.1B-parameter Llama of ``quantize_memory.py`` with the default
model's vocabulary (49152), written once as fp32 safetensors shards for qpage and as an F32
GGUF for llama.cpp (llama.cpp's tensor names, q/k rows in its rotary order, the default
model's tokenizer). Each round runs every tool once, in turn, each in its own process under
``/usr/bin/time -v`` (2 threads for llama.cpp; qpage uses its default threads), from a warm
page cache. Reported per tool: the quantizing call's own seconds (qpage's summary line;
around ``llama_model_quantize`` for llama.cpp), parameters per second from it, the whole
process's wall seconds and peak RSS; and the median over rounds of the per-round ratio
qpage / llama.cpp in parameters per second. Needs llama-cpp-python.

    python benchmarks/quantize_speed.py [--rounds 3] [--keep DIR] [--out F.json]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import write_json
from quantize_memory import CONFIG, make_model

ROOT = Path(__file__).resolve().parent.parent
FTYPES = {"Q4_0": 2, "Q4_1": 3}  # llama.cpp file types
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
LLAMA_CHILD = """
import ctypes, sys, time, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), 2
t = time.perf_counter()
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
print(f"SECONDS {time.perf_counter() - t:.3f}")
sys.exit(rc)
"""


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
    if m is None:
        raise ValueError(f"no GGUF name for {name}")
    return f"blk.{m.group(1)}.{GGUF_NAMES[m.group(2)]}.weight"


def write_gguf(src: Path, dst: Path, config: dict) -> None:
    """The safetensors model as an F32 GGUF llama.cpp reads (tokenizer from the default model)."""
    import gguf
    from safetensors import safe_open

    from qpage.formats.gguf import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.", "general.quantization_version")):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    c = config
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_file_type(0)
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "numpy") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = st.get_tensor(name).astype(np.float32)
                heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
                kind = next((k for k in heads if f".{k}." in name), None)
                if kind is not None:  # llama.cpp's rotary order: halves interleaved per head
                    n = heads[kind]
                    t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
                w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def timed(cmd: list[str]) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS bytes) of a child under /usr/bin/time -v."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{r.stderr[-3000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return r.stdout, wall, int(m.group(1)) * 1024 if m else -1


def run_qpage(src: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    stdout, wall, rss = timed([sys.executable, "-m", "qpage.cli", "quantize", str(src), str(out),
                               "--scheme", "int4-rtn", "--no-sym"])
    m = re.search(r"linears in ([\d.]+)s", stdout)
    if m is None:
        sys.exit(f"qpage printed no summary:\n{stdout[-2000:]}")
    shutil.rmtree(out)
    return dict(seconds=float(m.group(1)), wall=wall, rss=rss)


def run_llamacpp(gguf_file: Path, out: Path, ftype: int) -> dict[str, float]:
    stdout, wall, rss = timed([sys.executable, "-c", LLAMA_CHILD, str(gguf_file), str(out), str(ftype)])
    m = re.search(r"SECONDS ([\d.]+)", stdout)
    out.unlink()
    return dict(seconds=float(m.group(1)) if m else wall, wall=wall, rss=rss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", default=None, help="folder for the generated model (kept and reused)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantize_speed.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from qpage.formats.safetensors_io import read_header

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="qpage-qspeed-"))
    config = dict(CONFIG, vocab_size=49152)
    src, gguf_file = work / "random-1.1b-v49152", work / "random-1.1b-v49152.f32.gguf"
    try:
        if not (src / "config.json").is_file():
            src.mkdir(parents=True, exist_ok=True)
            make_model(src, 1 << 30, config)
        if not gguf_file.is_file():
            write_gguf(src, gguf_file.with_suffix(".tmp"), config)
            gguf_file.with_suffix(".tmp").rename(gguf_file)
        params = sum(int(np.prod(v["shape"])) for f in src.glob("*.safetensors") for v in read_header(f)[0].values())
        runs: dict[str, list[dict[str, float]]] = {"qpage int4-rtn asym g128": []}
        runs.update({f"llama.cpp {t}": [] for t in FTYPES})
        for r in range(args.rounds):
            runs["qpage int4-rtn asym g128"].append(run_qpage(src, work / "qpage-out"))
            for t, ftype in FTYPES.items():
                runs[f"llama.cpp {t}"].append(run_llamacpp(gguf_file, work / f"out.{t}.gguf", ftype))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.1f}s" for k, v in runs.items()), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ours = runs["qpage int4-rtn asym g128"]
    rows = []
    print(f"\n{params / 1e9:.2f}B parameters, {args.rounds} rounds (medians)")
    print(f"{'tool':<26} {'call s':>7} {'Mparam/s':>9} {'wall s':>7} {'peak RSS GB':>12} {'qpage / it':>11}")
    for name, rs in runs.items():
        ratio = statistics.median(x["seconds"] / o["seconds"] for o, x in zip(ours, rs, strict=True))
        row = dict(tool=name, seconds=statistics.median(x["seconds"] for x in rs),
                   wall=statistics.median(x["wall"] for x in rs), rss=max(x["rss"] for x in rs),
                   qpage_speed_ratio=ratio, runs=rs)
        row["params_per_second"] = params / row["seconds"]
        rows.append(row)
        print(f"{name:<26} {row['seconds']:>7.1f} {row['params_per_second'] / 1e6:>9.1f} {row['wall']:>7.1f} "
              f"{row['rss'] / 1e9:>12.2f} {ratio:>11.2f}")
    print(f"wrote {write_json(dict(params=params, rounds=args.rounds, rows=rows), args.out)}")


if __name__ == "__main__":
    main()
