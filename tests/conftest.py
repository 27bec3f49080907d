"""Session fixtures for tests on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import os

# Triton kernels run on CPU in its interpreter; the flag is read when triton is imported,
# so it is set before any test module imports qpage.kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from qpage.formats.gguf import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def hf_model(default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


LLM_CACHE_SIZE = 4
"""LLM instances ``llm_factory`` keeps. Each holds the model and its KV cache (0.6-1.6 GB);
kept for the whole session, the suite's two dozen argument sets held ~20 GB of this 24 GB
machine's memory."""


@pytest.fixture(scope="session")
def llm_factory(default_model_dir: Path) -> Callable[..., Any]:
    """LLM instances, one per distinct set of arguments, the most recently used
    ``LLM_CACHE_SIZE`` kept (tests that use one set of arguments sit together). Without a
    ``model`` they run the default model's weights dequantized to a float32 folder (exactly the
    weights transformers runs in the reference tests); ``model=None`` runs the GGUF natively."""
    import gc
    from collections import OrderedDict

    from qpage import LLM

    cache: OrderedDict[tuple, Any] = OrderedDict()

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("model", str(default_model_dir))
        key = tuple(sorted(kwargs.items()))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= LLM_CACHE_SIZE:
            cache.popitem(last=False)
            gc.collect()
        cache[key] = LLM(**kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llm(llm_factory: Callable[..., Any]) -> Any:
    return llm_factory()


@pytest.fixture(scope="session")
def gptq_act_order(default_model_dir: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as an INT4 GPTQ act-order checkpoint (groups of 128, calibrated on
    two 64-token windows of the README): what the packed CPU and tensor-parallel tests run."""
    from qpage.eval.perplexity import token_windows
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    calib = token_windows(tokenizer, Path(__file__).resolve().parents[1] / "README.md", 64, 2)
    out = tmp_path_factory.mktemp("gptq") / "gptq-act-order"
    quantize_checkpoint(default_model_dir, out, QuantScheme(4, 128, True, method="gptq", act_order=True),
                        progress=False, calib=calib)
    return out
