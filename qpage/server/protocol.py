"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Pydantic checks types; ``SamplingParams`` checks ranges, so both the Python API and the
server reject the same values with the same words. Unknown fields are ignored, as in
OpenAI's and vLLM's servers; fields qpage does not implement are refused by name rather
than silently dropped.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from qpage.sampling_params import SamplingParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error for the client, in OpenAI's JSON shape."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
        413: "invalid_request_error", 500: "server_error", 503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _check_common(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by qpage; remove it", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                stop=self.stop, seed=self.seed, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            )
        except ValueError as e:
            param = str(e).split("=", 1)[0] if "=" in str(e).split(" ", 1)[0] else None
            raise APIError(400, str(e), param) from None


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_common()
        if self.echo:
            raise APIError(400, "echo=true is not supported by qpage; leave it out", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by qpage; leave it out", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported; leave it out", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]", "logprobs")

    def prompts(self) -> list[str | dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", "prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        return [{"prompt_token_ids": list(x)} for x in p]  # type: ignore[arg-type]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"message content of type {part.type!r} is not supported; "
                                        "qpage serves text models: send text parts", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        if self.tools:
            raise APIError(400, "tools are not supported by qpage yet; leave them out", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs={self.top_logprobs} must be in [0, {MAX_LOGPROBS}]",
                               "top_logprobs")
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
