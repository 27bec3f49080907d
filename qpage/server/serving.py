"""The completions and chat handlers: requests in, engine streams, OpenAI bodies out."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qpage.sampling_params import SamplingParams, StructuredOutputsParams
from qpage.server.async_engine import AsyncEngine, RequestFailedError, RequestStream, Snapshot
from qpage.server.preprocess import Preprocessor, Prompt
from qpage.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from qpage.server.responses import ChatBuilder, CompletionBuilder, sse, usage
from qpage.server.tools import ToolCallReader, template_dicts, tool_constraint, tool_mode

CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, pre: Preprocessor, model_names: list[str], max_n: int) -> None:
        self.aengine = aengine
        self.pre = pre
        self.model_names = model_names
        self.max_n = max_n

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)} (GET /v1/models)",
                           "model", "model_not_found")

    async def _start(self, prompts: list[Prompt], params: SamplingParams, rid: str, add_special_tokens: bool,
                     max_tokens: int | None, param: str, grammar: Any = None) -> list[RequestStream]:
        """Tokenize (off the engine thread) and queue all of a request's prompts, or refuse it whole."""
        seqs, bound = len(prompts) * params.n, self.aengine.max_waiting
        if bound is not None and seqs > bound:
            raise APIError(400, f"this request has {seqs} sequences ({len(prompts)} prompts x n={params.n}), more "
                                f"than this server ever queues (--max-waiting {bound}); split it into smaller requests",
                           param if len(prompts) > 1 else "n")
        ready = await self.pre.prompts(prompts, add_special_tokens, max_tokens, param)
        return await self.aengine.generate(ready, params, rid, grammar=grammar)  # type: ignore[arg-type]

    async def _compile(self, structured: tuple[StructuredOutputsParams, str] | None, request: Request) -> Any:
        """The request's constraint compiled (None without one), queued as its client's."""
        if structured is None:
            return None
        client = request.client.host if request.client is not None else ""
        return await self.pre.compile(*structured, client, request.is_disconnected)

    # ------------------------------------------------------------------ completions
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body.check(self.max_n)
        self.check_model(body.model)
        structured = body.structured()
        params = body.sampling_params(body.max_tokens, body.logprobs, structured and structured[0])
        grammar = await self._compile(structured, request)
        rid = f"cmpl-{uuid.uuid4().hex}"
        explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
        streams = await self._start(body.prompts(), params, rid, True, explicit, "prompt", grammar)
        builder = CompletionBuilder(rid, self.model_names[0], body.n, body.logprobs is not None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse_response(self._stream_completion(streams, builder, include_usage), streams, request)
        finals = await _collect(streams, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = [builder.choice(i, c, c.text, 0, 0) for i, f in enumerate(finals) for c in f.outputs]
        return JSONResponse(builder.full(choices, _usage(finals)))

    async def _stream_completion(
        self, streams: list[RequestStream], builder: CompletionBuilder, include_usage: bool,
    ) -> AsyncIterator[str]:
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, index) -> (chars, tokens) sent
        finals: dict[int, Snapshot] = {}
        async for i, snap in _merge(streams):
            choices = []
            for c in snap.outputs:
                chars, toks = sent.get((i, c.index), (0, 0))
                if toks < 0:
                    continue  # already finished
                if len(c.text) == chars and c.finish_reason is None:
                    continue
                choices.append(builder.choice(i, c, c.text[chars:], toks, chars))
                sent[(i, c.index)] = (len(c.text), -1 if c.finish_reason else len(c.token_ids))
            if snap.finished:
                finals[i] = snap
            if choices:
                yield sse(builder.chunk(choices))
        if include_usage:
            yield sse(builder.chunk([], _usage(list(finals.values()))))
        yield sse("[DONE]")

    # ------------------------------------------------------------------ chat
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        body.check(self.max_n)
        self.check_model(body.model)
        mode, function = tool_mode(body)
        structured = body.structured()
        if (tc := tool_constraint(body, mode, function)) is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice={mode!r} constrains the output itself; leave {structured[1]} out",
                               structured[1])
            structured = (tc, "tools")
        params = body.sampling_params(body.requested_max_tokens(), body.logprobs_k(), structured and structured[0])
        grammar = await self._compile(structured, request)
        prompt = await self.pre.chat_ids([m.as_template_dict() for m in body.messages],
                                         body.add_generation_prompt and not body.continue_final_message,
                                         body.continue_final_message, template_dicts(body))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start([prompt], params, rid, False, body.requested_max_tokens(), "messages", grammar)
        reader = ToolCallReader(mode, function, self.pre.hermes_tools)
        builder = ChatBuilder(rid, self.model_names[0], body.logprobs_k(), reader if reader.parses else None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse_response(self._stream_chat(streams[0], builder, body.n, include_usage), streams, request)
        finals = await _collect(streams, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(builder.full(finals[0].outputs, _usage(finals)))

    async def _stream_chat(
        self, stream: RequestStream, builder: ChatBuilder, n: int, include_usage: bool,
    ) -> AsyncIterator[str]:
        yield sse(builder.chunk([builder.role(i) for i in range(n)]))
        sent: dict[int, tuple[int, int]] = {}
        final: Snapshot | None = None
        async for snap in stream:
            choices = []
            for c in snap.outputs:
                chars, toks = sent.get(c.index, (0, 0))
                if toks < 0 or (len(c.text) == chars and c.finish_reason is None):
                    continue
                choices += builder.deltas(c, chars, toks)
                sent[c.index] = (len(c.text), -1 if c.finish_reason else len(c.token_ids))
            if snap.finished:
                final = snap
            if choices:
                yield sse(builder.chunk(choices))
        if include_usage and final is not None:
            yield sse(builder.chunk([], _usage([final])))
        yield sse("[DONE]")


def _usage(finals: list[Snapshot]) -> dict[str, int]:
    return usage(sum(len(f.prompt_token_ids) for f in finals),
                 sum(len(c.token_ids) for f in finals for c in f.outputs))


async def _watch_disconnect(request: Request, streams: list[RequestStream]) -> None:
    """Abort the streams as soon as the client goes away."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for s in streams:
                s.close()
            return


async def _collect(streams: list[RequestStream], request: Request) -> list[Snapshot] | None:
    """The final snapshot of each stream, or None if the client left first."""

    async def last(s: RequestStream) -> Snapshot | None:
        snap = None
        async for snap in s:  # noqa: B007 - the last one is the result
            pass
        return snap

    watcher = asyncio.create_task(_watch_disconnect(request, streams))
    try:
        finals = await asyncio.gather(*(last(s) for s in streams))
    finally:
        watcher.cancel()
        for s in streams:
            s.close()
    if any(f is None or not f.finished for f in finals):
        return None
    return finals  # type: ignore[return-value]


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Snapshot]]:
    """Snapshots of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for snap in streams[0]:
            yield 0, snap
        return
    q: asyncio.Queue[tuple[int, Snapshot | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for snap in s:
                q.put_nowait((i, snap))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _sse_response(gen: AsyncIterator[str], streams: list[RequestStream], request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        watcher = asyncio.create_task(_watch_disconnect(request, streams))
        try:
            async for event in gen:
                yield event
        except Exception as e:  # the engine failed on this request mid-stream: say so, then end
            yield sse(APIError(e.status if isinstance(e, RequestFailedError) else 500, str(e)).body())
            yield sse("[DONE]")
        finally:
            watcher.cancel()
            for s in streams:
                s.close()
            with contextlib.suppress(Exception):
                await gen.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "qpage", "root": name,
            "parent": None, "max_model_len": max_model_len}
