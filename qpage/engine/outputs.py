"""Result types with vLLM's names and shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from qpage.runner.batch import Logprob

SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """'stop' (EOS, stop string or stop token), 'length' (max_tokens or context), 'abort', or
    'error' (this request failed inside the engine; ``RequestOutput.error`` says why)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one prompt so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Why the request failed inside the engine (its completions end with 'error'); None if not."""
    client_error: bool = False
    """The failure is the request's own doing (its grammar too costly to follow), not the engine's."""
