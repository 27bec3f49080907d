"""What runs around the app for every connection: the header deadline, the API key, the
body reader and the last line of defence against an unexpected error.

Order, outermost first: ``TimedH11Protocol`` (the request head within ``read_timeout``)
-> ``ApiKeyAuth`` (checked on the head alone, before any body byte is read) ->
``RequestReader`` (the body whole, bounded in size and time) -> ``ErrorBoundary`` -> the
FastAPI app. A refusal before the body is read (401, 415) keeps the connection: uvicorn
then drops the unread body as it arrives, holding no memory, and the head deadline bounds
how long that may take; closing at once could reset the connection before the client reads
the answer. A body cut off by its deadline (408) or an internal error (500) closes it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from uvicorn.protocols.http.h11_impl import H11Protocol

from qpage.server.protocol import APIError

log = logging.getLogger("qpage.server")
Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Send], Awaitable[None]]
RETRY_AFTER_S = 1
"""The ``Retry-After`` a 503 for a full queue carries: one engine step or so frees room."""


async def send_error(send: Send, err: APIError, close: bool = False, headers: dict[str, str] | None = None) -> None:
    """Send ``err`` as OpenAI's JSON error body; ``close`` ends the connection after it."""
    body = json.dumps(err.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def needs_key(scope: Scope) -> bool:
    """The one auth rule: every path needs the key except ``/health`` without ``verbose``. The
    query is decoded the way the app decodes it, so ``%76erbose`` counts as ``verbose``."""
    if scope["path"] != "/health":
        return True
    query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return any(k == "verbose" for k, _ in query)


class ApiKeyAuth:
    """``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``) where ``needs_key`` says so,
    decided on the request head: a refused request's body is never read into memory."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        what = "is missing" if not given and not headers.get(b"x-api-key") else "is wrong"
        await send_error(send, APIError(401, f"the API key {what}: send the server's key as 'Authorization: "
                                             "Bearer KEY'", code="invalid_api_key"))


class RequestReader:
    """Reads a request body whole before the app sees it: at most ``limit`` bytes (413),
    within ``timeout`` seconds (408), without a content encoding (415), valid UTF-8 (400)."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        encoding = dict(scope["headers"]).get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            name = encoding.decode("latin-1")
            return await send_error(send, APIError(
                415, f"this server reads uncompressed bodies only, not Content-Encoding {name!r}; send the JSON "
                     "body as is"))
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; a distinct class on 3.10
            return await send_error(send, APIError(
                408, f"the request body did not arrive within {self.timeout:g} s; send it at once, or start the "
                     "server with a larger --read-timeout"), close=True)
        if body is None:
            return None  # the client left
        if len(body) > self.limit:
            return await send_error(send, APIError(
                413, f"the request body is over this server's limit of {self.limit} bytes; send a shorter "
                     "prompt, or start the server with a larger --max-request-bytes"))
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await send_error(send, APIError(
                400, f"the request body is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8"))
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: wait for the disconnect

        return await self.app(scope, replay, send)

    async def _read(self, receive: Any) -> bytes | None:
        """The body, or None on disconnect; past the limit, the rest is read and dropped (so
        the client gets the 413 rather than a reset) and one byte too many is kept."""
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            part = msg.get("body", b"")
            if size <= self.limit:
                chunks.append(part[: self.limit + 1 - size])
            size += len(part)
            more = msg.get("more_body", False)
        return b"".join(chunks)


class ErrorBoundary:
    """Keeps an unexpected error inside its request. The app's handler has already answered
    500 (with ``Connection: close``) and logged the traceback, then Starlette re-raises; this
    stops it there, so the server logs it once and closes the connection cleanly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        started = False

        async def watch(msg: dict[str, Any]) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if scope["type"] != "http":
                raise
            if not started:
                log.exception("qpage: unexpected error")
                await send_error(send, APIError(500, f"internal error: {type(e).__name__}: {e}"), close=True)


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request head: a connection that
    has not sent a whole head ``header_timeout`` seconds after it opened (or after it started
    a new request) is closed, so slow or idle clients cannot hold connections open."""

    header_timeout: float = 30.0
    _timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimedH11Protocol]:
        return type("TimedH11Protocol", (cls,), {"header_timeout": seconds})

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._arm()
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
