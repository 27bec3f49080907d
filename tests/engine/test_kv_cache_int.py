"""int8/int4 KV caches in the engine on the default model: size, the exactness of the Hadamard
rotation, quality against the full-precision cache, greedy output, preemption, prefix
caching, and bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qpage import LLM, SamplingParams
from qpage.config import BLOCK_SIZE
from qpage.eval.perplexity import kl_rows, score_window
from qpage.kernels.cpu import native as cpu_native
from qpage.kernels.kv_int import hadamard
from qpage.layers.attention import selector as backends
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.selector import select_attention_backend
from tests.helpers import assert_greedy_agrees

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

MEM = "32MiB"
TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext2" / "test.txt"
README_PROMPT = "Explain what a KV cache is in two sentences."


def _window(tokenizer: Any, n: int = 384) -> list[int]:
    text = TEXT.read_text()[20000:40000] if TEXT.is_file() else (Path(__file__).parents[2] / "README.md").read_text()
    return tokenizer.encode(text, add_special_tokens=False)[:n]


@pytest.mark.parametrize(("dtype", "name", "bits", "k_and_v", "at_most"), [
    ("int8", "int8", (8, 8), 2 * (64 + 2), 0.53), ("int8_per_token_head", "int8", (8, 8), 2 * (64 + 2), 0.53),
    ("k8v4", "k8v4", (8, 4), 64 + 2 + 32 + 4, 0.40),
    ("int4", "int4", (4, 4), 2 * (32 + 4), 0.30), ("int4_per_token_head", "int4", (4, 4), 2 * (32 + 4), 0.30),
])
def test_bytes_capacity_and_layout(dtype: str, name: str, bits: tuple[int, int], k_and_v: int, at_most: float,
                                   capsys: pytest.CaptureFixture) -> None:
    llm = LLM(kv_cache_dtype=dtype, kv_cache_memory="16MiB", log_stats=True)
    eng = llm.llm_engine
    assert f"KV cache {name} (per-token-head" in capsys.readouterr().out
    a = eng.arch
    per_token = a.num_layers * a.num_kv_heads * k_and_v  # codes + fp16 parameters per head
    fp16 = KVCacheSpec(torch.float16).bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim)
    assert eng.kv_spec.bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim) == per_token
    assert per_token / fp16 <= at_most
    assert eng.kv.num_blocks == (16 << 20) // (per_token * BLOCK_SIZE)
    cache = eng.runner.caches[0]
    for codes, params, b in ((cache.k, cache.k_scale, bits[0]), (cache.v, cache.v_scale, bits[1])):
        assert codes.dtype == (torch.int8 if b == 8 else torch.uint8)
        assert codes.shape == (eng.kv.num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim * b // 8)
        assert params.shape == (eng.kv.num_blocks, BLOCK_SIZE, a.num_kv_heads, 1 if b == 8 else 2)
    assert cache.transform.rotation is not None and cache.transform.k_shift is not None


def test_rotation_is_exact(llm_factory: Any, tokenizer: Any) -> None:
    """The Hadamard rotation on a full-precision cache leaves the outputs unchanged."""
    ids = _window(tokenizer, 100)
    eng = llm_factory(enable_prefix_caching=False, kv_cache_memory=MEM).llm_engine
    base = score_window(eng, ids, 40)
    try:
        for c in eng.runner.caches:
            c.transform.rotation = hadamard(eng.arch.head_dim)[0]
        rotated = score_window(eng, ids, 40)
    finally:
        for c in eng.runner.caches:
            c.transform.rotation = None
    assert (rotated - base).abs().max() < 1e-3


def test_quality_against_auto_and_what_rotation_buys(llm_factory: Any, tokenizer: Any) -> None:
    """Teacher-forced over a 384-token window in chunks of 96 (context read back from the
    cache): mean KL(auto || mode). Measured here: int8 about 2e-4, int4 rotated about 0.03,
    int4 not rotated about 0.1 nats."""
    ids = _window(tokenizer)
    auto = score_window(llm_factory(kv_cache_memory=MEM).llm_engine, ids, 96)
    kl = {}
    for dtype, rotate in (("int8", True), ("k8v4", True), ("int4", True), ("int4", False)):
        eng = llm_factory(kv_cache_dtype=dtype, kv_cache_rotation=rotate, kv_cache_memory=MEM).llm_engine
        kl[dtype, rotate] = float(kl_rows(auto, score_window(eng, ids, 96)).mean())
    assert kl["int8", True] < 2e-3
    assert kl["k8v4", True] < 0.5 * kl["int4", True], kl
    assert kl["int4", True] < 0.06
    assert kl["int4", True] < 0.7 * kl["int4", False], kl


@pytest.mark.parametrize("backend", ["torch", "cpu-blas", "cpu-native"])
def test_int8_greedy_follows_auto_on_the_readme_prompt(llm_factory: Any, backend: str) -> None:
    """The README's command (chat template, greedy, the CLI's repetition penalty of 1.1): the
    int8 cache's answer follows the fp32 cache's by the shared rule (equal up to where they
    part, and there a near-tie on the penalised scores). Rounding upstream of the cache (the C
    kernels, or another CPU's BLAS code) moves some int8 codes, so such a parting is expected
    somewhere in a 59-token answer, where the penalty has left two tokens ~0.05 nats apart."""
    if backend == "cpu-native" and cpu_native.load() is None:
        pytest.skip("native CPU kernels unavailable")
    conv = [{"role": "user", "content": README_PROMPT}]
    p = SamplingParams(temperature=0, repetition_penalty=1.1, max_tokens=200, logprobs=5)
    kw: dict[str, Any] = dict(kv_cache_memory=MEM, attention_backend=backend, logprobs_mode="processed_logprobs")
    want = llm_factory(**kw).chat(conv, p, use_tqdm=False)[0].outputs[0]
    got = llm_factory(kv_cache_dtype="int8", **kw).chat(conv, p, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) > 40
    part = assert_greedy_agrees(want, got)
    print(f"[{backend}] int8 parts from fp32 at token {part} of {len(want.token_ids)}")


def _count(first: int, n: int) -> str:
    return ", ".join(str(i) for i in range(first, first + n)) + ","


# Counting continues with wide margins, so int4's rounding noise (which flips near-ties when a
# batch or a chunking changes fp32 rounding upstream) cannot change these answers, while a
# cache read wrongly after a preemption or a prefix hit would.
COUNTS = [_count(1, 6), _count(40, 5), _count(200, 4)]


def test_int4_preemption_recomputes_and_finishes() -> None:
    """A cache of 6 blocks for 3 requests that each need 3: requests are preempted, recomputed
    from their tokens, and end with the text each has alone on the same cache."""
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = LLM(kv_cache_dtype="int4", kv_cache_memory="4MiB", log_stats=False).llm_engine
    per_block = a.kv_spec.bytes_per_token(a.arch.num_layers, a.arch.num_kv_heads, a.arch.head_dim) * BLOCK_SIZE
    llm = LLM(kv_cache_dtype="int4", kv_cache_memory=6 * per_block, max_model_len=48, log_stats=False,
              enable_prefix_caching=False)
    solo = [llm.generate([q], p, use_tqdm=False)[0].outputs[0].text for q in COUNTS]
    assert solo[1].startswith(" 45, 46, 47, 48, 49, 50")
    outs = llm.generate(COUNTS, p, use_tqdm=False)
    assert llm.get_metrics()["qpage:num_preemptions_total"] > 0
    assert [o.outputs[0].text for o in outs] == solo
    assert llm.llm_engine.kv.usage() == 0


def test_int4_prefix_cache_hits_and_keeps_outputs(llm_factory: Any) -> None:
    prefix = _count(1, 40)  # 80 tokens: 5 full blocks shared
    prompts = [prefix + " 41,", prefix + " 41, 42,", prefix + " 41, 42, 43,"]
    p = SamplingParams(temperature=0, max_tokens=16)
    off = llm_factory(kv_cache_dtype="int4", enable_prefix_caching=False, kv_cache_memory=MEM)
    want = [o.outputs[0].text for o in off.generate(prompts, p, use_tqdm=False)]
    assert want[0].startswith(" 42, 43, 44, 45")
    on = llm_factory(kv_cache_dtype="int4", enable_prefix_caching=True, kv_cache_memory=MEM)
    got = [on.generate([q], p, use_tqdm=False)[0].outputs[0].text for q in prompts]
    assert on.get_metrics()["qpage:prefix_cache_hits"] >= 2 * 64
    assert got == want


def test_bad_names_and_modes_a_device_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int3' is not supported; choose one of auto, fp8, "
                                         "fp8_e4m3, fp8_e5m2, int8, int4, k8v4, int8_per_token_head, "
                                         "int4_per_token_head"):
        LLM(kv_cache_dtype="int3", log_stats=False)
    with pytest.raises(ValueError, match="kv_cache_scales='per_tensor' applies to FP8 caches only"):
        LLM(kv_cache_dtype="int4", kv_cache_scales="per_tensor", log_stats=False)
    with pytest.raises(ValueError, match="kv_cache_rotation=False applies to the int8, int4 and k8v4 caches only"):
        LLM(kv_cache_dtype="fp8", kv_cache_rotation=False, log_stats=False)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"kv cache int4 .*cpu-native: supports dtypes float32, not torch\.bfloat16"):
        select_attention_backend(cpu, KVCacheSpec(torch.bfloat16, int_bits=4), 64, "cpu-native")
    monkeypatch.setattr(backends, "INTERPRET", False)
    with pytest.raises(ValueError, match="triton: runs on cuda, not cpu; set TRITON_INTERPRET=1"):
        select_attention_backend(cpu, KVCacheSpec(torch.float32, int_bits=8), 64, "triton")
    with pytest.raises(ValueError, match="head_dim 2048 > 1024"):
        select_attention_backend(cpu, KVCacheSpec(torch.float32, int_bits=8), 2048)
    assert select_attention_backend(cpu, KVCacheSpec(torch.bfloat16, int_bits=4), 64).name == "torch"
