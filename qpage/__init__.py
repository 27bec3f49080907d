"""qpage: quantization-first, low-memory LLM inference."""

from qpage.engine.llm import LLM
from qpage.engine.outputs import CompletionOutput, Logprob, RequestOutput
from qpage.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from qpage.version import __version__

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "__version__"]
