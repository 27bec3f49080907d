"""Batch invariance on CPU: a greedy request's tokens and its prompt logprobs are the same bits
however the engine runs it: alone, beside 15 sampled neighbours, with prompts chunked at 16,
64 or 1024 tokens, preempted and recomputed under a tight KV budget, and over a prefix-cache
hit (prompt logprobs are compared in every run but that one, since a request for them
computes its whole prompt). Every KV cache format on the default model's GGUF (Q4_1 blocks);
other block formats on tiny llama.cpp fixtures, one dequantized (``dequantize_weights``); and
a tiny random Llama with an untied head as fp32 safetensors and as qpage writes it in FP8,
GPTQ INT4 act-order, INT8 and NF4 (every CPU weight path: dense panels, dequantized, integer
and NF4 blocks). docs/design.md states the scope."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from qpage import LLM, SamplingParams
from qpage.formats.scheme import QuantScheme
from qpage.quantizers.pipeline import quantize_checkpoint

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
PREFIX, OWN, NEW, NEIGHBOURS, TIGHT_BLOCKS = 96, 8, 24, 15, 24
CODE_BYTES = {"auto": 4.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """10 prompts sharing a PREFIX-token prefix, and NEIGHBOURS prompts of other lengths."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prefix = ids(PREFIX)
    return [prefix + ids(OWN) for _ in range(10)], [ids(int(n)) for n in torch.randint(5, 120, (NEIGHBOURS,),
                                                                                        generator=g)]


def _results(llm: Any, prompts: list[list[int]], neighbours: list[list[int]],
             prompt_logprobs: bool = True) -> list[tuple[Any, ...]]:
    """(tokens, their logprobs, prompt logprobs) of each of ``prompts``, run together with
    ``neighbours``. A request for prompt logprobs computes its whole prompt (no prefix-cache
    hit), so the prefix-hit run asks for none."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0 if prompt_logprobs else None)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=NEW + 8 * (i % 3), ignore_eos=True)
               for i in range(len(neighbours))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + neighbours],
                        [greedy] * len(prompts) + sampled, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), _logprobs(o.outputs[0].logprobs), _logprobs(o.prompt_logprobs))
            for o in outs[: len(prompts)]]


def _logprobs(entries: list[Any] | None) -> tuple[Any, ...] | None:
    return None if entries is None else tuple(tuple((k, v.logprob) for k, v in d.items()) if d else ()
                                              for d in entries)


def check_invariance(model: str | None, kv: str, **extra: Any) -> None:
    """Greedy tokens, their logprobs and prompt logprobs of ``model`` alone equal every other run's
    (batched, chunked, preempted, prefix hits); ``extra``: more engine settings."""
    base = {"model": model, "kv_cache_dtype": kv, "log_stats": False, "max_model_len": 256, **extra}
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=1024, **base)
    arch = llm.llm_engine.arch
    prompts, neighbours = _prompts(arch.vocab_size)
    alone = [r for p in prompts for r in _results(llm, [p], [])]
    runs = {"batched": _results(llm, prompts, neighbours)}
    del llm
    for chunk in (16, 64):
        llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=chunk, **base)
        runs[f"chunks of {chunk}"] = _results(llm, prompts, neighbours)
        del llm
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * CODE_BYTES[kv]
    llm = LLM(enable_prefix_caching=True, kv_cache_memory=int(TIGHT_BLOCKS * 16 * per_token), **base)
    runs["preempted"] = _results(llm, prompts, neighbours)
    assert llm.get_metrics()["qpage:num_preemptions_total"] > 0
    del llm
    llm = LLM(enable_prefix_caching=True, **base)
    _results(llm, prompts[:1], [])  # the shared prefix is cached
    runs["prefix hit"] = _results(llm, prompts, neighbours, prompt_logprobs=False)
    assert llm.get_metrics()["qpage:prefix_cache_hits"] >= 10 * (PREFIX // 16) * 16
    for name, got in runs.items():
        for i, (a, b) in enumerate(zip(alone, got, strict=True)):
            assert a[0] == b[0], f"{name}: prompt {i} tokens {a[0]} alone, {b[0]} here"
            assert a[1] == b[1], f"{name}: prompt {i} token logprobs differ from the run alone"
            assert b[2] is None or a[2] == b[2], f"{name}: prompt {i} prompt logprobs differ from the run alone"


@pytest.mark.parametrize("kv", ["auto", "fp8", "int8", "int4"])
def test_default_gguf_every_kv_format(kv: str) -> None:
    check_invariance(None, kv)


@pytest.mark.parametrize("name", ["Q4_K_M", "Q6_K", "IQ4_XS", "Q8_0"])
def test_block_formats(name: str) -> None:
    check_invariance(str(FIXTURES / f"tiny-llama.{name}.gguf"), "auto")


def test_block_format_dequantized() -> None:
    check_invariance(str(FIXTURES / "tiny-llama.Q4_K_M.gguf"), "auto", dequantize_weights=True)


@pytest.fixture(scope="module")
def tiny_checkpoints(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random 2-layer Llama on the default tokenizer's vocabulary (its files copied), untied,
    fp32 safetensors; and qpage's quantizations of it."""
    root = tmp_path_factory.mktemp("invariance")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    dense = root / "dense"
    transformers.LlamaForCausalLM(cfg).save_pretrained(dense, safe_serialization=True)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, dense / f.name)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(3, 49152, (64,), generator=g).tolist() for _ in range(2)]
    out = {"fp32": dense}
    for name, scheme in {"fp8": QuantScheme.parse("fp8"), "nf4": QuantScheme.parse("nf4"),
                         "gptq-int4-act-order": QuantScheme(4, 32, True, method="gptq", act_order=True),
                         "int8": QuantScheme(8, None, True)}.items():
        out[name] = root / name
        quantize_checkpoint(dense, out[name], scheme, progress=False, calib=calib)
    return out


@pytest.mark.parametrize("name", ["fp32", "fp8", "nf4", "gptq-int4-act-order", "int8"])
def test_checkpoint_formats(tiny_checkpoints: dict[str, Path], name: str) -> None:
    check_invariance(str(tiny_checkpoints[name]), "auto")
