"""The middleware in-process, on hand-made ASGI messages: the auth rule on decoded queries,
the body reader's bounds, and the error boundary's single log and closing 500."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fastapi import FastAPI

from qpage.server.app import install_error_handlers
from qpage.server.middleware import ErrorBoundary, RequestReader, needs_key


def http_scope(path: str, query: bytes = b"", method: str = "GET", headers: list | None = None) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
            "raw_path": path.encode(), "query_string": query, "headers": headers or [], "root_path": "",
            "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)}


def drive(app: Any, scope: dict[str, Any], chunks: list[bytes] | None = None) -> list[dict[str, Any]]:
    """Run ``app`` on ``scope``; ``chunks`` is the body (None: a client that never sends it)."""
    sent: list[dict[str, Any]] = []
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
             for i, c in enumerate(chunks or [])]

    async def receive() -> dict[str, Any]:
        if chunks is None or not queue:
            await asyncio.sleep(3600)
        return queue.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


@pytest.mark.parametrize(("path", "query", "want"), [
    ("/health", b"", False), ("/health", b"x=1", False), ("/health", b"verbose=1", True),
    ("/health", b"%76erbose=1", True), ("/health", b"verbose", True), ("/health", b"a=1&verbose=0", True),
    ("/v1/models", b"", True), ("/metrics", b"", True),
])
def test_one_auth_rule_on_the_decoded_query(path: str, query: bytes, want: bool) -> None:
    assert needs_key(http_scope(path, query)) is want


def test_error_boundary_answers_500_closes_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaboom")

    with caplog.at_level(logging.ERROR):
        sent = drive(ErrorBoundary(app), http_scope("/boom"), [b""])
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert start["status"] == 500 and (b"connection", b"close") in start["headers"]
    assert "kaboom" in body["error"]["message"] and body["error"]["type"] == "server_error"
    assert len([r for r in caplog.records if r.exc_info]) == 1


def echo_app() -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        msg = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": msg["body"]})

    return app


def test_reader_bounds_size_time_encoding_and_utf8() -> None:
    reader = RequestReader(echo_app(), limit=10, timeout=0.3)
    post = http_scope("/v1/completions", method="POST")

    def status(sent: list[dict[str, Any]]) -> int:
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    assert status(drive(reader, post, [b"12345", b"67890"])) == 200
    assert status(drive(reader, post, [b"12345", b"678901"])) == 413
    slow = drive(reader, post, None)
    assert status(slow) == 408 and (b"connection", b"close") in slow[0]["headers"]
    gz = http_scope("/v1/completions", method="POST", headers=[(b"content-encoding", b"gzip")])
    assert status(drive(reader, gz, [b"\x1f\x8b"])) == 415
    assert status(drive(reader, post, [b'"caf\xe9"'])) == 400
