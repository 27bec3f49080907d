"""Which CPU path is fastest for each quantized scheme.

Part 1, per layer: one quantized weight, y = x @ W at M rows, on every CPU path qpage has:
- ``blocks (C)``: the weight written as Q4_0/Q4_1/Q8_0/Q8_M blocks, int8 activations (with a
  residual level for Q8_M), qpage's C kernels (``cpu-blocks``, the default in every dtype);
- ``fp32 dequant (BLAS)``: dequantized once to fp32, NumPy/OpenBLAS matmul (qpage's fp32 path);
- ``bf16 dequant (torch)``: dequantized once to bf16, torch matmul;
- ``bf16 packed``: torch's int4pack / int8pack kernel on the packed weight (for weights the
  blocks cannot hold);
- ``fp16 packed``, ``fp32 packed``: torch's packed kernels with fp16 / fp32 activations
  (M=1 only: they are the slow ones).
Shapes: the default model's (576 -> 960 fused qkv, 576 -> 3072 gate/up, 1536 -> 576 down)
and two of Llama-3-8B (4096 -> 4096, 4096 -> 14336).

Part 2, end to end on the default model: RTN INT4 (g128, asym) and INT8 (g128, symmetric:
Q8_0 blocks, and asymmetric, the default: Q8_M) checkpoints and the shipped Q4_1 GGUF, loaded
with dtype float32 (packed on the block kernels; ``dequantize_weights=True``; without qpage's
C kernels, ``QPAGE_NATIVE=0``) and bfloat16 (and the dense model for scale): batch-1 decode
tokens/s, the attention backend and the memory the linear weights take. Each configuration
runs in its own
process. FP8 has no CPU kernel (``_scaled_mm`` is 20-50x slower than fp32, docs/quantization.md):
FP8 checkpoints dequantize, like the fp32 rows here.

    python benchmarks/cpu_paths.py [--reps 20] [--out benchmarks/results/cpu_paths.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [("smol qkv", 576, 960), ("smol gate_up", 576, 3072), ("smol down", 1536, 576),
          ("8B o_proj", 4096, 4096), ("8B gate", 4096, 14336)]
SCHEMES = [("int4 g128 asym", 4, 128, False, False), ("int4 g128 act-order", 4, 128, True, False),
           ("int8 g128 sym", 8, 128, False, True), ("int8 g128 asym", 8, 128, False, False)]
"""(label, bits, group size, act-order, symmetric)."""


def best_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1000 * best


def _weight_paths(k: int, n: int, bits: int, group: int, act: bool, sym: bool, g: torch.Generator
                  ) -> tuple[dict[str, Callable[[torch.Tensor], Any]], dict[str, int]]:
    """One random weight on every path: the matmuls, and the bytes each holds (``sym``: every
    zero at 2^(bits-1))."""
    import numpy as np

    from qpage.kernels.cpu.matmul import int_blocks, native_gguf
    from qpage.kernels.cpu.matmul import packed as cpu_packed
    from qpage.kernels.packing import dequantize_ref, pack_cols, pack_rows

    gs = group or k
    groups = -(-k // gs)
    q = torch.randint(0, 2**bits, (k, n), generator=g)
    z = (torch.full((groups, n), 1 << (bits - 1), dtype=torch.int64) if sym
         else torch.randint(0, 2**bits, (groups, n), generator=g))
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    g_idx = (torch.randperm(k, generator=g) // gs).int() if act else None
    dense = dequantize_ref(pack_rows(q, bits), s, pack_cols(z, bits), g_idx, bits=bits, group_size=gs, in_features=k)
    w32, wbf = dense.contiguous().numpy(), dense.t().bfloat16().contiguous()
    packed: dict[torch.dtype, Any] = {}
    has_packed = bits == 4 or groups == 1  # torch's int8 kernel takes one scale per channel only
    for dt in (torch.bfloat16, torch.float16, torch.float32) if has_packed else ():
        packed[dt] = cpu_packed.pack_int4(q, s, z, g_idx, gs, dt) if bits == 4 else cpu_packed.pack_int8(q, s, z, dt)
    mm = cpu_packed.int4_mm if bits == 4 else cpu_packed.int8_mm
    b = int_blocks.to_block_rows(q, s, z, g_idx, bits, gs)
    blocks = native_gguf.PiecewiseMatmul([(0, n, native_gguf.repack(b.rows, b.ggml_type, k))], k, n,
                                         input_perm=b.perm)
    fns: dict[str, Callable[[torch.Tensor], Any]] = {
        "blocks (C)": lambda x: blocks(x),
        "fp32 dequant (BLAS)": lambda x: np.matmul(x.numpy(), w32),
        "bf16 dequant (torch)": lambda x: torch.nn.functional.linear(x.bfloat16(), wbf),
        "bf16 packed": lambda x: mm(x, packed[torch.bfloat16]),
        "fp16 packed": lambda x: mm(x, packed[torch.float16]),
        "fp32 packed": lambda x: mm(x, packed[torch.float32]),
    }
    if not has_packed:
        fns = {p: f for p, f in fns.items() if "packed" not in p}
    nbytes = {"fp32 dequant": w32.nbytes, "bf16 dequant": 2 * k * n, "blocks": blocks.weight_bytes(),
              "packed": packed[torch.bfloat16].nbytes() if has_packed else None}
    return fns, nbytes


def layer_rows(ms: list[int], reps: int, shapes: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Every weight is prepared first; then each path is timed over all of them in turn.

    NOTE: one path at a time, because NumPy's BLAS threads and torch's OpenMP threads spin
    for a while after their calls and steal the two cores from each other: interleaving
    them per call produced 5-8 ms stalls in the first version of this benchmark.
    """
    g = torch.Generator().manual_seed(0)
    cases = []
    for shape, k, n in shapes:
        for scheme, bits, group, act, sym in SCHEMES:
            fns, nbytes = _weight_paths(k, n, bits, group, act, sym, g)
            for m in ms:
                x = torch.randn(m, k)
                inputs = {"blocks (C)": x, "fp32 dequant (BLAS)": x, "bf16 dequant (torch)": x.bfloat16(),
                          "bf16 packed": x.bfloat16(), "fp16 packed": x.half(), "fp32 packed": x}
                row: dict[str, Any] = dict(shape=shape, k=k, n=n, scheme=scheme, m=m, bytes=nbytes)
                cases.append((row, fns, inputs))
    for path in PATHS:
        for row, fns, inputs in cases:
            # torch's fp16 and fp32 packed paths are the slow ones (10-60x): timed at M=1 only
            slow = path in ("fp16 packed", "fp32 packed")
            row[path] = None if (slow and row["m"] != 1) or path not in fns else best_ms(
                lambda f=fns[path], x=inputs[path]: f(x), 3 if slow else reps)
    for row, _, _ in cases:
        print(_layer_line(row), flush=True)
    return [row for row, _, _ in cases]


PATHS = ["blocks (C)", "fp32 dequant (BLAS)", "bf16 dequant (torch)", "bf16 packed", "fp16 packed", "fp32 packed"]


def _layer_line(r: dict[str, Any]) -> str:
    cells = "".join(f"{r[p]:>12.3f}" if r[p] is not None else f"{'-':>12}" for p in PATHS)
    fastest = min((p for p in PATHS if r[p] is not None), key=lambda p: r[p])
    return f"{r['shape']:<13}{r['scheme']:<21}{r['m']:>4}{cells}   {fastest}"


def e2e_child(model: str, dtype: str, tokens: int, dequantize: bool) -> dict[str, Any]:
    from throughput import decode_b1  # this folder is on sys.path when run as a script

    from qpage import LLM, SamplingParams

    llm = LLM(model=model or None, dtype=dtype, kv_cache_memory="256MiB", log_stats=False,
              dequantize_weights=dequantize)
    eng = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(1000, 1128))}

    def gen(k: int) -> None:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True), use_tqdm=False)

    gen(4)
    tokens_per_s = decode_b1(gen, tokens)  # difference of minima, as in benchmarks/throughput.py
    linear_bytes = 0
    for mod in eng.model.modules():
        if hasattr(mod, "weight_bytes"):  # every linear layer, dense or quantized
            linear_bytes += mod.weight_bytes
    return dict(decode_tokens_per_s=tokens_per_s, linear_weight_bytes=linear_bytes,
                paths=eng.kernel_paths()["quantized_linears"], attention=eng.runner.backend.name,
                one_call_decode=eng.model.decode_stack is not None)


def e2e_rows(tokens: int) -> list[dict[str, Any]]:
    from qpage.formats.gguf import default_model_dir
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    work = Path(tempfile.mkdtemp(prefix="qpage-cpu-paths-"))
    models = {"dense": str(default_model_dir()), "gguf Q4_1": ""}
    for name, scheme in (("int4 g128 asym", QuantScheme(4, 128, False)), ("int8 g128 sym", QuantScheme(8, 128, True)),
                         ("int8 g128 asym", QuantScheme(8, 128, False))):
        out = work / name.replace(" ", "_")
        quantize_checkpoint(default_model_dir(), out, scheme, progress=False)
        models[name] = str(out)
    rows = []
    # fp32 three times: packed on the block kernels, dequantized on request, and without qpage's
    # C kernels (QPAGE_NATIVE=0: dequantized, BLAS attention, torch ops).
    configs = (("float32", "1", "0"), ("float32", "1", "1"), ("float32", "0", "0"), ("bfloat16", "1", "0"))
    for name, path in models.items():
        for dtype, native, dequant in configs:
            if name == "dense" and dequant == "1":
                continue
            cmd = [sys.executable, __file__, "--child", path, dtype, str(tokens), dequant]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  env={**os.environ, "QPAGE_NATIVE": native})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name} {dtype} failed:\n{proc.stderr[-3000:]}")
            r = dict(model=name, dtype=dtype, native=native == "1", dequantized=dequant == "1", **json.loads(line[7:]))
            rows.append(r)
            how = "dequantized" if dequant == "1" else "C off" if native == "0" else "default"
            print(f"{name:<16}{dtype:<10}{how:<13}{r['attention']:<12}{r['decode_tokens_per_s']:>10.1f}"
                  f"{r['linear_weight_bytes'] / 2**20:>12.1f}   {r['paths']}", flush=True)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 16, 128])
    ap.add_argument("--small", action="store_true", help="default-model shapes only (a quick check)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded for the end-to-end figure")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_paths.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = e2e_child(args.child[0], args.child[1], int(args.child[2]), args.child[3] == "1")
        print("RESULT " + json.dumps(result), flush=True)
        return
    print(f"per layer, best of {args.reps}, ms (torch threads {torch.get_num_threads()})")
    print(f"{'shape':<13}{'scheme':<21}{'M':>4}" + "".join(f"{p[:11]:>12}" for p in PATHS) + "   fastest")
    shapes = SHAPES[:3] if args.small else SHAPES
    result: dict[str, Any] = {"layers": layer_rows(args.m, args.reps, shapes)}
    if not args.no_e2e:
        print(f"\nend to end, default model, batch-1 decode of {args.tokens} tokens")
        print(f"{'model':<16}{'dtype':<10}{'weights':<13}{'attention':<12}{'tokens/s':>10}{'linears MiB':>12}   "
              "quantized linear paths")
        result["e2e"] = e2e_rows(args.tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
