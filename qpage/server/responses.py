"""OpenAI response bodies (completions and chat, whole and streamed) from engine snapshots."""

from __future__ import annotations

import json
import time
from typing import Any

from qpage.engine.outputs import Logprob
from qpage.server.async_engine import CompletionSnap
from qpage.server.tools import ToolCallReader


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _entry_text(t: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else str(t)


def completion_logprobs(
    tokens: list[int], entries: list[dict[int, Logprob]], offset0: int,
) -> dict[str, Any]:
    """The completions API's logprobs object for ``tokens`` (one entry dict per token)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for t, entry in zip(tokens, entries, strict=False):
        chosen = entry[t]
        text = _entry_text(t, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({_entry_text(k, v): v.logprob for k, v in entry.items()})
        out["text_offset"].append(off)
        off += len(text)
    return out


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """The chat API's logprobs object: per token, its logprob and the top ``k`` by rank."""
    content = []
    for t, entry in zip(tokens, entries, strict=False):
        chosen = entry[t]
        text = _entry_text(t, chosen)
        tops = sorted(((v.rank, tid, v) for tid, v in entry.items() if v.rank is not None and v.rank <= k),
                      key=lambda r: r[0])[:k]
        content.append({
            "token": text, "logprob": chosen.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": _entry_text(tid, v), "logprob": v.logprob,
                              "bytes": list(_entry_text(tid, v).encode())} for _, tid, v in tops],
        })
    return {"content": content}


class CompletionBuilder:
    """Builds completions-API bodies; choice index = prompt index * n + completion index."""

    def __init__(self, rid: str, model: str, n: int, want_logprobs: bool) -> None:
        self.rid, self.model, self.n, self.want_logprobs = rid, model, n, want_logprobs
        self.created = int(time.time())

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}

    def choice(self, prompt_i: int, c: CompletionSnap, text: str, first_tok: int, text_offset: int) -> dict[str, Any]:
        lp = None
        if self.want_logprobs and c.logprobs is not None:
            lp = completion_logprobs(c.token_ids[first_tok:], c.logprobs[first_tok:], text_offset)
        return {"index": prompt_i * self.n + c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def full(self, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
        return {**self._head(), "choices": sorted(choices, key=lambda c: c["index"]), "usage": use}

    def chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> dict[str, Any]:
        body = {**self._head(), "choices": choices}
        if use is not None:
            body["usage"] = use
        return body


class ChatBuilder:
    """Builds chat-API bodies (``chat.completion`` and ``chat.completion.chunk``). With a
    ``ToolCallReader`` the text is read as tool calls (``server.tools``); each streamed
    choice then gets its own copy of it."""

    def __init__(self, rid: str, model: str, logprobs_k: int | None, tools: ToolCallReader | None = None) -> None:
        self.rid, self.model, self.logprobs_k, self.tools = rid, model, logprobs_k, tools
        self.created = int(time.time())
        self._readers: dict[int, ToolCallReader] = {}

    def _lp(self, c: CompletionSnap, first_tok: int) -> dict[str, Any] | None:
        if self.logprobs_k is None or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids[first_tok:], c.logprobs[first_tok:], self.logprobs_k)

    def _message(self, c: CompletionSnap) -> tuple[dict[str, Any], str | None]:
        """(message, finish_reason) of a finished completion."""
        if self.tools is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        return self.tools.message(c.text, c.finish_reason, c.stop_reason)

    def full(self, comps: list[CompletionSnap], use: dict[str, int]) -> dict[str, Any]:
        choices = []
        for c in comps:
            msg, finish = self._message(c)
            choices.append({"index": c.index, "message": msg, "logprobs": self._lp(c, 0), "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": use}

    def chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": choices}
        if use is not None:
            body["usage"] = use
        return body

    def deltas(self, c: CompletionSnap, chars: int, first_tok: int) -> list[dict[str, Any]]:
        """The stream choices for what ``c`` gained since ``chars`` characters and ``first_tok`` tokens."""
        if self.tools is None:
            return [{"index": c.index, "delta": {"content": c.text[chars:]}, "logprobs": self._lp(c, first_tok),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]
        reader = self._readers.setdefault(c.index, ToolCallReader(self.tools.mode, self.tools.name, self.tools.hermes))
        delta, finish = reader.feed(c.text, c.finish_reason, c.stop_reason)
        if not delta and finish is None:
            return []
        return [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish,
                 "stop_reason": c.stop_reason if finish else None}]

    def role(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
