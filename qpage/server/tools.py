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
A call cut off by ``max_tokens`` is returned as content with ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from qpage.sampling_params import StructuredOutputsParams
from qpage.server.protocol import APIError, ChatCompletionRequest

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)
_DECODER = json.JSONDecoder()


def _params_schema(tool: Any) -> dict[str, Any]:
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


def tool_constraint(body: ChatCompletionRequest, mode: str, name: str | None) -> StructuredOutputsParams | None:
    """The output constraint of ``named`` and ``required`` (None for the free modes)."""
    tools = body.tools or []
    if mode == "named":
        tool = next(t for t in tools if t.function.name == name)
        return StructuredOutputsParams(json=_params_schema(tool))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _params_schema(t)},
              "required": ["name", "arguments"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def template_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape), or None."""
    if not body.tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]


def _call(name: str, arguments: Any, index: int | None = None) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": args}}
    return out if index is None else {"index": index, **out}


def _array_calls(text: str, start: int) -> tuple[list[tuple[str, Any]], int]:
    """Complete ``{"name", "arguments"}`` objects of a JSON array from ``start``; (calls, end)."""
    calls, pos = [], start
    while True:
        while pos < len(text) and text[pos] in " \t\r\n[,":
            pos += 1
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls, pos
        if not isinstance(obj, dict) or "name" not in obj:
            return calls, pos
        calls.append((obj["name"], obj.get("arguments", {})))
        pos = end


def _hermes_calls(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """(content outside the tags, calls) of Hermes-format text; a tag that does not hold a
    call's JSON stays in the content."""
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
    return "".join(content).strip(), calls


class ToolCallReader:
    """One completion's text read as a chat message in a tool mode, whole (``message``) or
    as the deltas of a stream (``feed``, called with the text so far)."""

    def __init__(self, mode: str, name: str | None, hermes: bool) -> None:
        self.mode, self.name, self.hermes = mode, name, hermes
        self._sent = 0  # characters of text consumed, or calls emitted (required)
        self._calls = 0
        self._id: str | None = None

    @property
    def parses(self) -> bool:
        """Whether this mode reads tool calls at all (else the text is plain content)."""
        return self.mode in ("named", "required") or (self.mode == "auto" and self.hermes)

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(message, finish_reason) for the whole completion."""
        calls: list[tuple[str, Any]] = []
        content: str | None = text
        if finish == "stop" and self.mode == "named":
            calls, content = [(self.name or "", text)], None
        elif finish == "stop" and self.mode == "required":
            calls, content = _array_calls(text, 0)[0], None
        elif self.mode == "auto" and self.hermes:
            content, calls = _hermes_calls(text)
            content = content or (None if calls else "")
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [_call(n, a) for n, a in calls]
            return msg, "tool_calls"
        return msg, finish

    def feed(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(delta bodies to send now, finish_reason to send) given the text so far."""
        if self.mode == "named":
            return self._feed_named(text, finish)
        if self.mode == "required":
            calls, _ = _array_calls(text, 0)
            new = [_call(n, a, self._calls + i) for i, (n, a) in enumerate(calls[self._calls:])]
            self._calls = len(calls)
            deltas = [{"tool_calls": [c]} for c in new]
            if finish == "length" and not calls:
                deltas.append({"content": text})
            return deltas, ("tool_calls" if finish == "stop" else finish)
        return self._feed_hermes(text, finish)

    def _feed_named(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        deltas = []
        if self._id is None and (text or finish):
            self._id = f"call_{uuid.uuid4().hex[:24]}"
            deltas.append({"tool_calls": [{"index": 0, "id": self._id, "type": "function",
                                           "function": {"name": self.name, "arguments": ""}}]})
        if len(text) > self._sent:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self._sent:]}}]})
            self._sent = len(text)
        return deltas, ("tool_calls" if finish == "stop" else finish)

    def _feed_hermes(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Content streams until a ``<tool_call>`` tag may begin; from there the text is held
        and read as calls when the completion ends."""
        held = text.find(HERMES_OPEN)
        if held < 0:  # hold back a tail that could still grow into the tag
            held = next((i for i in range(max(0, len(text) - len(HERMES_OPEN) + 1), len(text))
                         if HERMES_OPEN.startswith(text[i:])), len(text))
        upto = len(text) if finish else held
        deltas = []
        if finish:
            content, calls = _hermes_calls(text[self._sent:])
            if content:
                deltas.append({"content": content})
            deltas += [{"tool_calls": [_call(n, a, i)]} for i, (n, a) in enumerate(calls)]
            self._sent = upto
            return deltas, ("tool_calls" if calls else finish)
        if upto > self._sent:
            deltas.append({"content": text[self._sent:upto]})
            self._sent = upto
        return deltas, None
