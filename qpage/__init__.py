"""qpage: quantization-first, low-memory LLM inference."""

from qpage.engine.llm import LLM
from qpage.engine.outputs import CompletionOutput, Logprob, RequestOutput
from qpage.sampling_params import SamplingParams
from qpage.version import __version__

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
