"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Pydantic checks types strictly (a JSON boolean is not a number; text must be encodable as
UTF-8, so a lone surrogate is refused by field); ``SamplingParams`` checks ranges, so both
the Python API and the server reject the same values with the same words. Unknown fields
are ignored, as in OpenAI's and vLLM's servers; fields qpage does not implement are refused
by name rather than silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

from qpage.sampling_params import SamplingParams, StructuredOutputsParams


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
    response_format: dict[str, Any] | None = None
    # structured outputs, vLLM's current field and its older guided_* ones
    structured_outputs: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None

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

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's output constraint and the field it came from, or None."""
        given = {name: v for name in (*_GUIDED, "structured_outputs", "response_format")
                 if (v := getattr(self, name)) is not None}
        if given.get("response_format", {}).get("type", "text") == "text":
            given.pop("response_format", None)
        if len(given) > 1:
            raise APIError(400, f"give one output constraint, not {', '.join(given)}", next(iter(given)))
        if not given:
            return None
        name, value = next(iter(given.items()))
        try:
            if name == "structured_outputs":
                return StructuredOutputsParams(**value), name
            if name == "response_format":
                return _response_format(value), name
            return StructuredOutputsParams(**{_GUIDED[name]: value}), name
        except (TypeError, ValueError) as e:
            raise APIError(400, f"{name}: {e}", name) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if self.guided_whitespace_pattern is not None:
            raise APIError(400, "guided_whitespace_pattern is not supported by qpage; leave it out (set "
                                "structured_outputs.disable_any_whitespace for compact JSON)",
                           "guided_whitespace_pattern")
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                stop=self.stop, seed=self.seed, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                structured_outputs=structured,
            )
        except ValueError as e:
            param = str(e).split("=", 1)[0] if "=" in str(e).split(" ", 1)[0] else None
            raise APIError(400, str(e), param) from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's ``response_format`` (json_object or json_schema) as a constraint."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise ValueError("json_schema type needs {'json_schema': {'name': ..., 'schema': {...}}}")
    return StructuredOutputsParams(json=js["schema"])


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


class FunctionDef(_Body):
    """A function tool: its name (as OpenAI allows them), description and arguments schema."""

    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    """One entry of ``tools`` (OpenAI's function tools; the only type there is)."""

    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: Text


class NamedToolChoice(_Body):
    """``tool_choice`` naming one function: its arguments are then constrained to its schema."""

    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Body):
    name: Text
    arguments: Text


class ToolCall(_Body):
    """A call in an earlier assistant message (``arguments`` is JSON text)."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

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
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:  # chat templates take the arguments as a mapping (transformers' convention)
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    """A tool call's JSON arguments as the mapping chat templates expect; 400 if not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text[:80]!r}", "messages") from None
    except RecursionError:
        raise APIError(400, "a tool call's arguments nest too deeply to read", "messages") from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True

    def check(self, max_n: int) -> None:
        self._check_common(max_n)
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
