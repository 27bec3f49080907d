"""Bad input gets a clear error naming the value and the fix; the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qpage import LLM, SamplingParams


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": -0.5}, r"temperature=-0.5 is invalid: it must be >= 0"),
    ({"top_p": 0.0}, r"top_p=0.0 is invalid: it must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5 is invalid"),
    ({"top_k": -3}, r"top_k=-3 is invalid"),
    ({"min_p": 2.0}, r"min_p=2.0 is invalid"),
    ({"max_tokens": 0}, r"max_tokens=0 is invalid"),
    ({"max_tokens": -5}, r"max_tokens=-5 is invalid"),
    ({"n": 0}, r"n=0 is invalid"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 is invalid"),
    ({"presence_penalty": 3.0}, r"presence_penalty=3.0 is invalid"),
    ({"min_tokens": 10, "max_tokens": 5}, r"min_tokens=10 is invalid: it must not exceed max_tokens=5"),
    ({"logprobs": -1}, r"logprobs=-1 is invalid"),
    ({"stop": [""]}, r"stop strings must not be empty"),
    ({"stop": 5}, r"stop=5 must be a string or a list of strings"),
    # Non-finite numbers, booleans as numbers and out-of-range seeds are refused by field.
    ({"temperature": float("nan")}, r"temperature=nan is invalid: it must be a finite number"),
    ({"temperature": float("inf")}, r"temperature=inf is invalid: it must be a finite number"),
    ({"repetition_penalty": float("nan")}, r"repetition_penalty=nan is invalid: it must be a finite number"),
    ({"top_p": float("nan")}, r"top_p=nan is invalid"),
    ({"min_p": float("-inf")}, r"min_p=-inf is invalid"),
    ({"max_tokens": True}, r"max_tokens=True is invalid"),
    ({"n": True}, r"n=True is invalid: it must be an integer"),
    ({"seed": 2**64}, r"seed=18446744073709551616 is invalid: it must be an integer in"),
    ({"seed": -(2**63) - 1}, r"seed=-9223372036854775809 is invalid"),
])
def test_invalid_sampling_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm_factory: Any) -> None:
    llm = llm_factory(max_model_len=256, kv_cache_memory="64MiB")
    engine = llm.llm_engine
    ok = engine.add_request("The sky is", SamplingParams(temperature=0, max_tokens=8))  # in flight
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens, but max_model_len is 256: shorten"):
        llm.generate("word " * 400, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of ints"):
        llm.generate({"prompt_token_ids": [1, -4]}, use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    # A batch with one bad prompt adds none of it; the earlier request still completes.
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 1
    outs = llm.generate("The grass is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert outs[0].outputs[0].token_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert ok not in engine._requests
    assert engine.kv.usage() == 0.0


@pytest.mark.slow
def test_generation_capped_at_max_model_len(llm_factory: Any) -> None:
    llm = llm_factory(max_model_len=256, kv_cache_memory="64MiB")
    prompt = "count: " + " ".join(str(i) for i in range(60))
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    comp = out[0].outputs[0]
    assert comp.finish_reason == "length" and n_prompt + len(comp.token_ids) == 256


def test_unknown_model_path() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; pass a local Hugging Face model folder"):
        LLM(model="/nonexistent/model-dir")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*not supported.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_bin_only_checkpoint_refused(tmp_path: Path, default_model_dir: Path) -> None:
    import shutil

    for f in default_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model.bin\).*allow_pickle=True"):
        LLM(model=str(tmp_path), kv_cache_memory="16MiB")


def test_engine_config_errors() -> None:
    with pytest.raises(ValueError, match="dtype='float64' is not supported"):
        LLM(dtype="float64")
    with pytest.raises(ValueError, match="kv_cache_memory='lots' is not a byte count"):
        LLM(kv_cache_memory="lots")
    with pytest.raises(ValueError, match=r"max_model_len=4096 does not fit the KV cache, which holds \d+ tokens"):
        LLM(max_model_len=4096, kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="trust_remote_code=True is not supported"):
        LLM(trust_remote_code=True)
    with pytest.raises(ValueError, match="logprobs_mode='processed' is not supported; choose one of raw_logprobs, "
                                         "processed_logprobs"):
        LLM(logprobs_mode="processed")
    with pytest.raises(TypeError):
        LLM(not_an_option=1)  # type: ignore[call-arg]
