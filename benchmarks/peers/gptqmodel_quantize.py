"""Quantize a model folder with GPTQModel (the peer GPTQ tool), on the same calibration windows
qpage's benchmarks use: ``token_windows`` of a text file, or random token windows.

Runs in its own process (GPTQModel sets up worker pools and thread counts at import).
Recipe (installed by scripts/install_peers.sh): GPTQMODEL_CPU_WORKERS=2 (else a worker-pool
error on 2 cores), a temp GPTQMODEL_TORCH_EXTENSIONS_DIR, the device given only in QuantizeConfig.

    python benchmarks/peers/gptqmodel_quantize.py SRC OUT [--calib valid.txt --samples 128 --seq-len 512]
        [--random-windows N] [--bits 4] [--group-size 128] [--desc-act] [--asym]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--calib", default=None)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--random-windows", type=int, default=0, help="use N random-token windows instead of text")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--desc-act", action="store_true")
    ap.add_argument("--asym", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    os.environ.setdefault("GPTQMODEL_TORCH_EXTENSIONS_DIR", tempfile.mkdtemp(prefix="gptqmodel-ext-"))
    import torch

    if args.random_windows:
        vocab = json.loads((Path(args.src) / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        windows = [torch.randint(0, vocab, (args.seq_len,), generator=g).tolist() for _ in range(args.random_windows)]
    else:
        from transformers import AutoTokenizer

        from qpage.eval.perplexity import token_windows

        tok = AutoTokenizer.from_pretrained(args.src)
        windows = token_windows(tok, Path(args.calib), args.seq_len, args.samples,
                                max_chars=200 * args.seq_len * args.samples)
    from gptqmodel import GPTQModel, QuantizeConfig

    qc = QuantizeConfig(bits=args.bits, group_size=args.group_size, sym=not args.asym, desc_act=args.desc_act,
                        device="cpu")
    t0 = time.perf_counter()
    model = GPTQModel.load(args.src, qc)
    data = [{"input_ids": torch.tensor([w]), "attention_mask": torch.ones(1, len(w), dtype=torch.long)}
            for w in windows]
    model.quantize(data, batch_size=1)
    model.save(args.out)
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "windows": len(windows)}), flush=True)


if __name__ == "__main__":
    main()
