"""The engine on a GPU, end to end, against transformers: a small random-weight Llama.

The GPU machine has no model hub and no copy of the default model's weights, so this builds
a 4-layer model with the default model's shapes (hidden 576, 9 heads, 3 kv heads, vocab
49152) and random weights, saves it as a safetensors checkpoint with the default model's
tokenizer, and runs it through ``qpage.LLM`` (Triton attention backend on CUDA) with the
``auto`` and ``fp8`` KV caches. Reference: transformers' forward pass on the same
checkpoint, teacher-forced on the prompt plus qpage's generated tokens; reported: the
largest |logprob difference| of the chosen tokens and whether each greedy token was
transformers' argmax (or a near-tie within 0.05). Prints a table and writes JSON.

    python benchmarks/gpu_engine_check.py [--device cuda] [--tokenizer DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import write_json

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "Three primary colors are"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--tokenizer", default=None, help="folder with the tokenizer files (default: the default model)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--quantized", action="store_true",
                   help="also quantize the model (int4-rtn g128, GPTQ format) and compare CUDA with CPU")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_engine_check.json"))
    return p.parse_args()


def build_model(tok_dir: Path, layers: int, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)


def hf_logprobs(model_dir: Path, ids: list[int], device: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
    return torch.log_softmax(logits, -1).cpu()


def check_quantized(model_dir: Path, device: str, tokens: int) -> dict[str, Any]:
    """The GPTQ-format INT4 checkpoint on ``device`` (Triton kernels on CUDA) against the CPU
    path (weights dequantized once), teacher-forced on the same ids."""
    from qpage import LLM, SamplingParams
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    qdir = model_dir.parent / (model_dir.name + "-int4")
    quantize_checkpoint(model_dir, qdir, QuantScheme(4, 128, True), progress=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=0, ignore_eos=True)
        gpu = LLM(model=str(qdir), device=device, dtype="float16" if device == "cuda" else "float32",
                  kv_cache_memory="256MiB", max_num_batched_tokens=8)
        outs = gpu.generate(PROMPTS, params, use_tqdm=False)
        cpu = LLM(model=str(qdir), device="cpu", dtype="float32", kv_cache_memory="64MiB")
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        worst, agree, total = 0.0, 0, 0
        for o in outs:
            ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            ref = cpu.generate({"prompt_token_ids": ids}, score, use_tqdm=False)[0].prompt_logprobs
            start = len(o.prompt_token_ids)
            for i, tok in enumerate(o.outputs[0].token_ids):
                worst = max(worst, abs(o.outputs[0].logprobs[i][tok].logprob - ref[start + i][tok].logprob))
                agree += int(ref[start + i][tok].rank <= 1)
                total += 1
    finally:
        shutil.rmtree(qdir, ignore_errors=True)
    print(f"int4 GPTQ checkpoint on {device}: max |logprob diff| vs CPU {worst:.4f}, greedy tokens that are the "
          f"CPU argmax {agree}/{total}", flush=True)
    return dict(kv_cache="int4-gptq-format", device=device, max_abs_logprob_diff_vs_cpu=worst, greedy_agree=agree,
                tokens=total)


def main() -> None:
    args = parse_args()
    import torch

    from qpage import LLM, SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tokenizer:
        tok_dir = Path(args.tokenizer)
    else:
        from qpage.formats.gguf import default_model_dir

        tok_dir = default_model_dir()
    work = Path(tempfile.mkdtemp(prefix="qpage-gpu-check-"))
    rows: list[dict[str, Any]] = []
    try:
        build_model(tok_dir, args.layers, work)
        dtype = "float16" if device == "cuda" else "float32"
        for kv in ("auto", "fp8"):
            t = time.perf_counter()
            llm = LLM(model=str(work), device=device, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="256MiB",
                      max_num_batched_tokens=8)  # chunks of 8: later chunks read the paged cache
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.tokens, logprobs=0,
                                                        ignore_eos=True), use_tqdm=False)
            elapsed = time.perf_counter() - t
            worst, agree, total = 0.0, 0, 0
            for o in outs:
                ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                ref = hf_logprobs(work, ids, device)
                start = len(o.prompt_token_ids)
                for i, tok in enumerate(o.outputs[0].token_ids):
                    row = ref[start + i - 1]
                    ours = o.outputs[0].logprobs[i][tok].logprob
                    worst = max(worst, abs(ours - float(row[tok])))
                    top2 = row.topk(2).values
                    agree += int(tok == int(row.argmax()) or float(top2[0] - row[tok]) < 0.05)
                    total += 1
            rows.append(dict(kv_cache=kv, device=device, dtype=dtype, attention=llm.llm_engine.runner.backend.name,
                             max_abs_logprob_diff=worst, greedy_agree=agree, tokens=total, seconds=elapsed))
            print(f"kv {kv}: attention {rows[-1]['attention']}, max |logprob diff| {worst:.4f}, "
                  f"greedy tokens agreeing with transformers {agree}/{total}", flush=True)
        if args.quantized:
            rows.append(check_quantized(work, device, args.tokens))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = write_json(rows, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
