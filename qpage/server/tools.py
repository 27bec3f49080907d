"""Tool calls in the chat API: the output constraint a ``tool_choice`` implies, and the
calls read back from the generated text, whole or as streamed deltas.

Modes:
- ``named`` (``tool_choice={"type": "function", ...}``): the output is constrained to the
  function's ``parameters`` schema; the text is the call's arguments.
- ``required``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "arguments": {...}}`` objects, each naming one of the tools.
- ``auto``: the output is free; calls are read from the model's own format when the chat
  template defines the Hermes one (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
  as in Qwen2.5/Qwen3, Hermes and SmolLM3 templates); other templates give plain content.
- ``none``: plain content.
``finish_reason`` is "tool_calls" only when the output ended as its grammar (or format)
ends it; a call cut off by ``max_tokens`` (or, in the unconstrained ``auto`` mode, a stop
string) keeps that reason (``ToolCallReader``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from qpage.sampling_params import StructuredOutputsParams
from qpage.server.json_copy import copy_json
from qpage.server.protocol import APIError, ChatCompletionRequest

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)
_DECODER = json.JSONDecoder()


def _params_schema(tool: Any) -> dict[str, Any]:
    """A tool's arguments schema (any object when it declares none)."""
    return tool.function.parameters or {"type": "object"}


def tool_mode(body: ChatCompletionRequest) -> tuple[str, str | None]:
    """(mode, function name for ``named``); 400 for a tool_choice the tools cannot meet."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise APIError(400, f"tool_choice={choice!r} needs tools; add tools or leave tool_choice out",
                           "tool_choice")
        return choice, None
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                            f"tools ({', '.join(map(repr, names)) or 'none given'})", "tool_choice")
    return "named", choice.function.name


def _rebase(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose local references (``"$ref": "#..."``) point under ``base``."""
    return copy_json(schema, lambda k, s: base + s[1:] if k == "$ref" and s.startswith("#") else s)


def _tool_defs(tools: list[Any]) -> dict[str, Any]:
    """Each tool's arguments schema under ``$defs/tool<i>`` of the array of calls, its local
    references rebased there: ``#`` and ``#/$defs/...`` inside a tool keep meaning that tool's
    own schema, nested as it is under the array."""
    defs = {}
    for i, t in enumerate(tools):
        schema = _params_schema(t)
        for key in ("$defs", "definitions"):
            if key in schema and not isinstance(schema[key], dict):
                raise APIError(400, f"the tool {t.function.name!r} has {key} of type {type(schema[key]).__name__}; "
                                    f"{key} must be an object of schemas", "tools")
        defs[f"tool{i}"] = _rebase(schema, f"#/$defs/tool{i}")
    return defs


def tool_constraint(body: ChatCompletionRequest, mode: str, name: str | None) -> StructuredOutputsParams | None:
    """The output constraint of ``named`` and ``required`` (None for the free modes)."""
    tools = body.tools or []
    if mode == "named":
        tool = next(t for t in tools if t.function.name == name)
        return StructuredOutputsParams(json=_params_schema(tool))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                "arguments": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "arguments"]} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": _tool_defs(tools)}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def template_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape), or None."""
    if not body.tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]


def _call(name: str, arguments: Any, index: int) -> dict[str, Any]:
    """One call in OpenAI's shape (with the ``index`` stream deltas carry); ``arguments`` as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _array_calls(text: str) -> list[tuple[str, Any]]:
    """The complete ``{"name", "arguments"}`` objects of a (possibly unfinished) JSON array."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n[,":
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls
        if not isinstance(obj, dict) or "name" not in obj:
            return calls
        calls.append((obj["name"], obj.get("arguments", {})))


def _hermes_calls(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """(text outside the tags, calls) of Hermes-format text; a tag that does not hold a
    call's JSON stays in the text."""
    calls, content, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        content.append(text[last:m.start()])
        last = m.end()
        calls.append((name, args))
    content.append(text[last:])
    return "".join(content), calls


class ToolCallReader:
    """One completion's text read as a chat message in a tool mode, whole (``message``) or
    as stream deltas (``feed``, called with the text so far). Both give the same calls: a
    named call's arguments as generated so far, the complete calls of ``required``, the
    tagged calls of ``auto``. ``finish_reason`` becomes "tool_calls" only when the output
    ended as its grammar (or the model's own format) ends it, not at ``max_tokens`` or (in
    ``auto``, which is unconstrained) a stop string."""

    def __init__(self, mode: str, name: str | None, hermes: bool) -> None:
        self.mode, self.name, self.hermes = mode, name, hermes
        self._sent = 0  # characters of text sent (named: arguments; auto: content)
        self._calls = 0  # calls sent
        self._named_id: str | None = None

    @property
    def parses(self) -> bool:
        """Whether this mode reads tool calls at all (else the text is plain content)."""
        return self.mode in ("named", "required") or (self.mode == "auto" and self.hermes)

    def _read(self, text: str, finish: str | None, stop_reason: object) -> tuple[str | None, list[tuple[str, Any]],
                                                                                  str | None]:
        """(content, calls, finish_reason) of ``text`` as it stands."""
        ended = finish == "stop" and stop_reason is None  # the grammar, or the model, ended it
        if self.mode == "named":
            calls = [(self.name or "", text)] if text or finish else []
        elif self.mode == "required":
            calls = _array_calls(text)
            if not calls and finish:
                return text, [], finish
        else:
            rest, calls = _hermes_calls(text)
            return (rest.strip() or None if calls else text), calls, ("tool_calls" if calls and finish else finish)
        return None, calls, ("tool_calls" if ended and calls else finish)

    def message(self, text: str, finish: str | None, stop_reason: object) -> tuple[dict[str, Any], str | None]:
        """(message, finish_reason) for the whole completion."""
        content, calls, finish = self._read(text, finish, stop_reason)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [_call(n, a, i) for i, (n, a) in enumerate(calls)]
            for c in msg["tool_calls"]:
                del c["index"]
        return msg, finish

    def feed(self, text: str, finish: str | None, stop_reason: object) -> tuple[dict[str, Any], str | None]:
        """(delta to send now, possibly empty; finish_reason to send) given the text so far."""
        if self.mode == "auto":
            return self._feed_hermes(text, finish, stop_reason)
        content, calls, finish = self._read(text, finish, stop_reason)
        delta: dict[str, Any] = {}
        if self.mode == "named" and calls:
            args = calls[0][1]
            if self._named_id is None:
                first = _call(self.name or "", args, 0)
                self._named_id = first["id"]
                delta["tool_calls"] = [first]
            elif len(args) > self._sent:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": args[self._sent:]}}]
            self._sent = len(args)
        elif calls[self._calls:]:
            delta["tool_calls"] = [_call(n, a, self._calls + i) for i, (n, a) in enumerate(calls[self._calls:])]
            self._calls = len(calls)
        if content and finish:
            delta["content"] = content
        return delta, finish

    def _feed_hermes(self, text: str, finish: str | None, stop_reason: object) -> tuple[dict[str, Any], str | None]:
        """Content streams until a ``<tool_call>`` tag may begin; from there the text is held
        and read as calls when the completion ends."""
        if finish:
            rest, calls = _hermes_calls(text[self._sent:])
            self._sent = len(text)
            delta: dict[str, Any] = {}
            if calls:
                delta["tool_calls"] = [_call(n, a, i) for i, (n, a) in enumerate(calls)]
            if rest.strip() if calls else rest:
                delta["content"] = rest.rstrip() if calls else rest
            return delta, ("tool_calls" if calls else finish)
        held = text.find(HERMES_OPEN)
        if held < 0:  # hold back a tail that could still grow into the tag
            held = next((i for i in range(max(0, len(text) - len(HERMES_OPEN) + 1), len(text))
                         if HERMES_OPEN.startswith(text[i:])), len(text))
        if held <= self._sent:
            return {}, None
        delta = {"content": text[self._sent:held]}
        self._sent = held
        return delta, None
