"""What the half2 INT4 GEMV's fp16 rounding does to a real model, measured on CPU.

The half2 GEMV (``qpage/kernels/quant_gemv_h2.py``, opt-in) sums each word's 8 products in
fp16 where every other kernel accumulates in fp32. This scores the default model, quantized
to INT4 (RTN, group 128, GPTQ layout), on wikitext-2 ``test.txt`` windows twice, with every
quantized linear run by a torch model of a GPU kernel's arithmetic:

- ``fp32 GEMV``: activations rounded to fp16, products and sums in fp32, output rounded to
  fp16 (``int_matmul_ref`` on fp16 inputs: what the default GEMV computes);
- ``half2 GEMV``: the same fp16 inputs through ``h2_gemv_ref``, bit for bit the half2
  kernel's arithmetic (its tests hold the kernel, under the interpreter, and its PTX, in a
  numpy model, to that function).

Everything else runs as usual (fp32 on CPU). On a GPU the half2 kernel would serve batch-1
decode only; here it serves every row, prefill included, so the difference is an upper
bound. Reported: perplexity of each and the mean and max KL(fp32 GEMV || half2 GEMV) of the
next-token distributions.

    python benchmarks/h2_numerics.py [--windows 8] [--window 256] [--sym]
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    p.add_argument("--sym", action="store_true", help="symmetric INT4 (default: with zero points)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "h2_numerics.json"))
    return p.parse_args()


def emulate_linears(mode: dict[str, str]) -> None:
    """Makes every ``IntLinear`` keep its packed tensors and run the arithmetic ``mode["name"]``
    names (read at each call, so one loaded model serves both)."""
    import torch
    from qpage.kernels.quant_gemv_h2 import h2_gemv_ref
    from qpage.kernels.quant_matmul import int_matmul_ref

    from qpage.layers.linear.quant_linear import IntLinear

    def prepare(self: IntLinear, dtype: torch.dtype) -> None:
        if self.cfg.bits != 4 or self.g_idx is not None:
            raise SystemExit("this benchmark quantizes 4-bit weights without act-order")
        self.kernel_path = "emulated"

    def fused(self: IntLinear, x: torch.Tensor) -> torch.Tensor:
        group = self.cfg.group_size or self.in_features
        x16 = x.to(torch.float16)
        if mode["name"] == "half2":
            y = h2_gemv_ref(x16, self.qweight, self.scales, self.qzeros, group_size=group)
        else:
            y = int_matmul_ref(x16, self.qweight, self.scales, self.qzeros, None, bits=4, group_size=group)
        return y.to(x.dtype)

    IntLinear.prepare = prepare  # type: ignore[method-assign]
    IntLinear.fused = fused  # type: ignore[method-assign]


def main() -> None:
    args = parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(f"{args.data}: no such text file; pass --data FILE")
    from kv_cache import write_json  # type: ignore[import-not-found]  (benchmarks/, the script's folder)

    from qpage import LLM
    from qpage.eval.perplexity import kl_rows, nll_sum, score_window, token_windows
    from qpage.formats.gguf import default_model_dir
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    mode = {"name": "fp32"}
    emulate_linears(mode)
    work = Path(tempfile.mkdtemp(prefix="qpage-h2-"))
    try:
        out = work / "int4"
        quantize_checkpoint(default_model_dir(), out, QuantScheme.parse("int4-rtn", group_size=128, sym=args.sym),
                            progress=False)
        eng = LLM(model=str(out), max_model_len=args.window, kv_cache_memory="64MiB", enable_prefix_caching=False,
                  log_stats=False).llm_engine
        windows = token_windows(eng.tokenizer, Path(args.data), args.window, args.windows,
                                max_chars=200 * args.window * args.windows)
        nll = {"fp32": 0.0, "half2": 0.0}
        kl_sum, kl_max, count = 0.0, 0.0, 0
        t0 = time.perf_counter()
        for w, ids in enumerate(windows):
            mode["name"] = "fp32"
            base = score_window(eng, ids, args.chunk)
            mode["name"] = "half2"
            lp = score_window(eng, ids, args.chunk)
            nll["fp32"] += nll_sum(base, ids)
            nll["half2"] += nll_sum(lp, ids)
            rows = kl_rows(base, lp)
            kl_sum += float(rows.sum())
            kl_max = max(kl_max, float(rows.max()))
            count += len(ids) - 1
            print(f"window {w + 1}/{len(windows)} ({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"{k} ppl {math.exp(v / count):.4f}" for k, v in nll.items())
                  + f", mean KL {kl_sum / count:.2e}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ppl = {k: math.exp(v / count) for k, v in nll.items()}
    result: dict[str, Any] = dict(
        scheme=f"int4-rtn g128 {'sym' if args.sym else 'asym'}", windows=len(windows), window=args.window,
        chunk=args.chunk, tokens_scored=count, perplexity=ppl, ppl_delta_pct=100 * (ppl["half2"] / ppl["fp32"] - 1),
        mean_kl=kl_sum / count, max_kl=kl_max)
    path = Path(args.out)
    write_json(result, path)
    print(f"\n{result['scheme']}, {len(windows)} windows x {args.window} tokens, {count} positions scored")
    print(f"{'linears as':<12} {'perplexity':>11}")
    for k, v in ppl.items():
        print(f"{k + ' GEMV':<12} {v:>11.4f}")
    print(f"half2 vs fp32: {result['ppl_delta_pct']:+.4f}% perplexity, mean KL {result['mean_kl']:.2e}, "
          f"max KL {kl_max:.2e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
