"""gpt-oss's MXFP4 safetensors in qpage against llama.cpp's own conversion of the same checkpoint.

``--make DIR`` writes a random gpt-oss of about 1B parameters (``gguf_moe.SPEED_GPT_OSS``: 18
layers of 32 experts, 4 per token) as OpenAI publishes gpt-oss (experts in MXFP4 blocks, the
rest float), and converts that folder with llama.cpp's converter (``llamacpp_convert.py``: the
experts stay MXFP4, repacked by llama.cpp; the rest F32). The two hold the same weights.

Then qpage runs both: the logits of one 64-token prompt from each (in this process; the two
must be equal), and, each source in its own fresh process in alternating rounds, the load
time, peak RSS after load, the linear weights' bytes and batch-1 greedy decode tokens/s
(128 tokens after a short prompt). ``benchmarks/vs_llamacpp.py --gguf`` times llama.cpp on
the converted file.

    python benchmarks/mxfp4_checkpoint.py --make DIR [--rounds 3] [--out F.json]
    python benchmarks/mxfp4_checkpoint.py --folder DIR/gpt-oss-1b-mxfp4 --gguf DIR/gpt-oss-1b-mxfp4.gguf
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parent.parent
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from qpage import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory="256MiB", max_model_len=2048, log_stats=False)
load = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss would carry over a larger parent's across fork and exec)
rss = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")) / 1024
weights = sum(getattr(m, "weight_bytes", 0) or 0 for m in llm.llm_engine.model.modules())
llm.generate("The history of the town", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
t = time.perf_counter()
llm.generate("The history of the town", SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
decode = 128 / (time.perf_counter() - t)
print(json.dumps(dict(load_s=load, peak_rss_mib=rss, weight_mib=weights / 2**20, decode=decode)))
"""


def make(out: Path) -> tuple[Path, Path]:
    """The MXFP4 folder and llama.cpp's GGUF of it, under ``out``."""
    from gguf_moe import SPEED_GPT_OSS, build
    from llamacpp_convert import convert

    from qpage.formats.gguf import default_model_dir
    from tests.formats.mxfp4_writing import write_mxfp4

    folder, gguf = out / "gpt-oss-1b-mxfp4", out / "gpt-oss-1b-mxfp4.gguf"
    float_dir = build(*SPEED_GPT_OSS, out / "gpt-oss-1b-float", default_model_dir())
    write_mxfp4(float_dir, folder)
    shutil.rmtree(float_dir)  # several GB of fp32
    convert(folder, gguf)
    return folder, gguf


def same_logits(folder: Path, gguf: Path) -> float:
    """Largest |difference| of the prompt logits qpage computes from the two sources."""
    import torch

    from tests.helpers import RunnerHarness

    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    got = []
    for path in (folder, gguf):
        h = RunnerHarness(path, num_blocks=16)
        got.append(h.step([(h.request("a", ids), len(ids))])["a"])
        del h
    return float((got[0] - got[1]).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", type=Path, default=None, help="write the two files into this folder first")
    p.add_argument("--folder", type=Path, default=None)
    p.add_argument("--gguf", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mxfp4_checkpoint.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.make:
        args.folder, args.gguf = make(args.make)
    if args.folder is None or args.gguf is None:
        raise SystemExit("pass --make DIR, or --folder and --gguf")
    diff = same_logits(args.folder, args.gguf)
    print(f"max |logit difference| between the two sources: {diff:.3g}")
    if diff != 0:
        raise SystemExit("the two sources hold the same weights, so qpage's logits must be equal")
    runs: dict[str, list[dict[str, float]]] = {"safetensors (MXFP4)": [], "gguf (llama.cpp's conversion)": []}
    for r in range(args.rounds):
        for label, path in zip(runs, (args.folder, args.gguf), strict=True):
            done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                                  check=False, cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {label}: {runs[label][-1]}", flush=True)
    rows: list[dict[str, Any]] = [{"source": label, **{k: statistics.median(x[k] for x in v) for k in v[0]}}
                                  for label, v in runs.items()]
    print(f"\n{'source':<32} {'load s':>7} {'peak RSS MiB':>13} {'weights MiB':>12} {'decode tok/s':>13}")
    for row in rows:
        print(f"{row['source']:<32} {row['load_s']:>7.2f} {row['peak_rss_mib']:>13.0f} {row['weight_mib']:>12.0f} "
              f"{row['decode']:>13.1f}")
    print(f"wrote {write_json(dict(max_logit_diff=diff, rounds=args.rounds, rows=rows), args.out)}")


if __name__ == "__main__":
    main()
