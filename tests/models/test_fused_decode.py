"""The whole decode step in one C call (``models.fused_decode``) against the Python layers it
replaces, on the default model's GGUF, on a Q4_K_M file (Q4_K and Q6_K layers), and on
INT4, INT8 and NF4 checkpoints written by ``qpage quantize`` (Q4_1, Q8_M with its residual
activation level, and NF4 blocks): the same kernels in the same order, so the tokens and
their log-probabilities must be equal, bit for bit, over batches that hold several decode
groups (sequences of different lengths) and rows. Bad step inputs are refused before C runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import qpage.models.llama as llama_module
from qpage import SamplingParams
from qpage.formats.scheme import QuantScheme
from qpage.kernels.cpu import native as cpu_native
from qpage.quantizers.pipeline import quantize_checkpoint

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

LENGTHS = (7, 20, 40, 150, 300)  # 1 to 19 blocks: several decode groups
Q4_K_M = Path(__file__).resolve().parents[1] / "fixtures" / "gguf" / "tiny-llama.Q4_K_M.gguf"


@pytest.fixture(scope="module")
def gguf_llm(llm_factory: Any) -> Any:
    return llm_factory(model=None)


def run(llm: Any) -> list[Any]:
    vocab = llm.llm_engine.arch.vocab_size
    prompts = [{"prompt_token_ids": [(1000 + 37 * i + t) % vocab for t in range(n)]} for i, n in enumerate(LENGTHS)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["default-gguf", "q4_k_m", "int4-rtn", "int8-rtn", "nf4"])
def fused_llm(request: pytest.FixtureRequest, gguf_llm: Any, llm_factory: Any, default_model_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "default-gguf":
        return gguf_llm
    if request.param == "q4_k_m":
        return llm_factory(model=str(Q4_K_M), kv_cache_memory="16MiB")
    out = tmp_path_factory.mktemp("fused") / request.param
    scheme = QuantScheme.parse(request.param)  # 4 and 8 bits: g128 asymmetric, the defaults
    quantize_checkpoint(default_model_dir, out, scheme, progress=False)
    return llm_factory(model=str(out))


def test_fused_step_equals_the_python_layers(fused_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused_llm.llm_engine.model.decode_stack is not None, "the model should fit the fused step"
    assert_fused_equals_python(fused_llm, llama_module, monkeypatch)


def assert_fused_equals_python(llm: Any, module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step runs on whole batches (counted through ``module``'s ``run_decode_stack``),
    and its tokens and logprobs equal the Python layers' bit for bit."""
    calls = []
    real = module.run_decode_stack

    def counted(*args: Any) -> Any:
        calls.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(module, "run_decode_stack", counted)
    fused = run(llm)
    assert calls and max(calls) == len(LENGTHS)  # it ran, on whole batches
    monkeypatch.setattr(llm.llm_engine.model, "decode_stack", None)
    python = run(llm)
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert {k: v.logprob for k, v in la.items()} == {k: v.logprob for k, v in lb.items()}


def test_bad_step_inputs_are_refused(gguf_llm: Any) -> None:
    stack = gguf_llm.llm_engine.model.decode_stack
    assert stack is not None
    caches = gguf_llm.llm_engine.runner.caches
    stack.bind([(c.k, c.v) for c in caches], [0] * len(caches))
    hidden, hd = stack.hidden, stack.shape.head_dim
    h, cs = torch.zeros(2, hidden), torch.zeros(2, hd)
    table, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    slots2 = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="do not describe 2 decode rows"):
        stack(h, [(cs, cs)], [(torch.zeros(1, dtype=torch.long), [(0, 2, table, lens)])])  # one slot for two rows
    with pytest.raises(ValueError, match="do not describe 2 decode rows"):
        stack(h, [(cs, cs)], [(slots2, [(0, 1, table[:1], lens[:1])])])  # a row without a group
    with pytest.raises(ValueError, match="do not describe 2 decode rows"):
        stack(h, [], [(slots2, [(0, 2, table, lens)])])  # no rotary table
    with pytest.raises(ValueError, match="outside the cache"):
        stack(h, [(cs, cs)], [(torch.full((2,), 10**9, dtype=torch.long), [(0, 2, table, lens)])])


def test_fused_step_is_chosen_once_for_the_engines_attention_and_cache(gguf_llm: Any, llm_factory: Any) -> None:
    """The fused step reads plain fp32 cache blocks with the C attention: an engine with another
    backend or cache runs the Python layers, decided at start (the same model file)."""
    assert gguf_llm.llm_engine.model.decode_stack is not None
    for kw in ({"attention_backend": "cpu-blas"}, {"kv_cache_dtype": "fp8"}):
        llm = llm_factory(model=None, kv_cache_memory="16MiB", **kw)
        assert llm.llm_engine.model.decode_stack is None, kw
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_gguf(request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """A random Gemma in Q8_0 as llama.cpp lays it out (``tests.formats.test_gguf_gemma``), a 16-token
    window: local and global layers, two KV groups on Gemma 3, soft caps on Gemma 2."""
    import gguf

    from tests.formats.test_gguf_gemma import gemma, write_gemma_gguf

    folder = tmp_path_factory.mktemp(request.param)
    model = gemma(request.param, folder, default_model_dir, sliding_window=16, max_position_embeddings=512)
    return write_gemma_gguf(request.param, model, folder, folder / "model.gguf", gguf.GGMLQuantizationType.Q8_0)


def test_fused_gemma_step_equals_the_python_layers(gemma_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's norms around attention and MLP, GeGLU, q/k norms, local rotary tables, windows,
    soft caps and one table per KV group, in the one C call: bit for bit the Python layers."""
    from qpage import LLM

    llm = LLM(model=str(gemma_gguf), kv_cache_memory="64MiB", max_model_len=512, log_stats=False)
    model = llm.llm_engine.model
    assert model.decode_stack is not None, "the model should fit the fused step"
    assert_fused_equals_python(llm, sys.modules[type(model).__module__], monkeypatch)  # models.gemma
