"""The default model with the Triton attention backend (cache write + paged attention kernels,
run by Triton's interpreter on CPU) against the CPU path, a few tokens each."""

from __future__ import annotations

from typing import Any

import pytest

from qpage import SamplingParams
from tests.helpers import assert_greedy_agrees

pytestmark = pytest.mark.slow  # see pyproject.toml's markers

PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8", "int4"])
def test_triton_backend_matches_cpu_path(llm_factory: Any, kv_cache_dtype: str) -> None:
    # Chunks of 6 tokens: the prefill kernel reads earlier chunks from the paged cache.
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=0)
    runs = {}
    for backend in ("cpu-blas", "triton"):
        llm = llm_factory(attention_backend=backend, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=6,
                          enable_prefix_caching=False, kv_cache_memory="16MiB")
        assert llm.llm_engine.runner.backend.name == backend
        # The FP8 cache write searches 8 scales per head: slow in the interpreter, so one prompt.
        runs[backend] = llm.generate(PROMPTS if kv_cache_dtype == "auto" else PROMPTS[:1], p, use_tqdm=False)
    # auto: same math up to float rounding. Quantized caches: a 1e-6 difference can move a value
    # across a rounding boundary and change a code, so logprobs agree only to quantization noise.
    tol = 2e-4 if kv_cache_dtype == "auto" else 0.1
    for a, b in zip(runs["cpu-blas"], runs["triton"], strict=True):
        part = assert_greedy_agrees(a.outputs[0], b.outputs[0])
        lp_a = [next(iter(d.values())).logprob for d in a.prompt_logprobs[1:]]
        lp_b = [next(iter(d.values())).logprob for d in b.prompt_logprobs[1:]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) < tol
        if part is None:
            assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < tol * 4
