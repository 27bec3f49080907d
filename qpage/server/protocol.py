"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Pydantic checks types strictly (a JSON boolean is not a number; text must be encodable as
UTF-8, so a lone surrogate is refused by field); ``SamplingParams`` checks ranges, so both
the Python API and the server reject the same values with the same words. Unknown fields
are ignored, as in OpenAI's and vLLM's servers; fields qpage does not implement are refused
by name rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

from qpage.sampling_params import SamplingParams


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text has a character that UTF-8 cannot encode ({e.reason} at index {e.start}); "
                         "send valid Unicode (no lone surrogates)") from None
    return text


Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), AfterValidator(_utf8)]
# vLLM fields the server does not implement: refused by name instead of silently ignored.
UNSUPPORTED = {
    "prompt_logprobs": "prompt_logprobs is not supported by the server (the Python API has it); leave it out",
    "use_beam_search": "beam search is not supported by qpage; leave use_beam_search out",
    "guided_json": "guided decoding is not supported by qpage yet; leave guided_json out",
    "guided_regex": "guided decoding is not supported by qpage yet; leave guided_regex out",
    "guided_choice": "guided decoding is not supported by qpage yet; leave guided_choice out",
    "guided_grammar": "guided decoding is not supported by qpage yet; leave guided_grammar out",
    "allowed_token_ids": "allowed_token_ids is not supported by qpage; leave it out",
    "bad_words": "bad_words is not supported by qpage; leave it out",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported by qpage; shorten the prompt instead",
    "functions": "functions are not supported by qpage; leave them out",
    "function_call": "function_call is not supported by qpage; leave it out",
}

MAX_LOGPROBS = 20
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 1000, 256
"""Bounds on stop conditions: each is checked on every generated token, on the engine thread."""


class APIError(Exception):
    """An error for the client, in OpenAI's JSON shape."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
        408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
        500: "server_error", 503: "server_error",
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
    include_usage: Bool = False


class _SamplingRequest(_Body):
    model_config = ConfigDict(extra="allow")  # kept so that unimplemented fields are refused by name

    model: Text | None = None
    max_tokens: Int | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    n: Int = 1
    stop: Text | list[Text] | None = None
    seed: Int | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's extras
    top_k: Int = 0
    min_p: Float = 0.0
    repetition_penalty: Float = 1.0
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False

    def _check_common(self, max_n: int) -> None:
        for name in self.model_extra or {}:
            if name in UNSUPPORTED:
                raise APIError(400, UNSUPPORTED[name], name)
        if self.n > max_n:
            raise APIError(400, f"n={self.n} is over this server's limit of {max_n} completions per request; "
                                "lower n, or start the server with a larger --max-n", "n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise APIError(400, f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", "stop")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
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


PromptField = Text | list[Text] | list[Int] | list[list[Int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool = False
    suffix: Text | None = None
    best_of: Int | None = None

    def check(self, max_n: int) -> None:
        self._check_common(max_n)
        if self.echo:
            raise APIError(400, "echo=true is not supported by qpage; leave it out", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by qpage; leave it out", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported; leave it out", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]", "logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token ids: one string, a list of strings, one list of ids,
        or a list of lists of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Body):
    type: Text
    text: Text | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

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
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self, max_n: int) -> None:
        self._check_common(max_n)
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
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Int]
