"""Peer row for benchmarks/quality.py: bitsandbytes NF4 (4-bit NormalFloat, blocks of 64,
fp32 compute) through transformers on CPU, scored on the same test windows.

bitsandbytes quantizes at load (no calibration, no checkpoint format qpage reads), so the
row is scored by transformers with the same per-window next-token NLL as qpage's scorer; the
unquantized model is scored the same way first, and its perplexity must equal qpage's
unquantized row (the check that the two scorers agree).

    python benchmarks/peers/bnb_nf4_eval.py SRC WINDOWS.json OUT.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch


def perplexity(model: torch.nn.Module, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            t = torch.tensor([ids])
            logits = model(t).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum").double())
            count += len(ids) - 1
    return math.exp(nll / count)


def main() -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    src, windows_file, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    windows = json.loads(windows_file.read_text())
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    base = perplexity(dense, windows)
    del dense
    t = time.perf_counter()
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, dtype=torch.float32,
                                                 device_map="cpu").eval()
    secs = time.perf_counter() - t
    import bitsandbytes

    res = dict(perplexity=perplexity(model, windows), unquantized_perplexity_transformers=base,
               memory_bytes=model.get_memory_footprint(), quantize_seconds=secs, version=bitsandbytes.__version__)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
