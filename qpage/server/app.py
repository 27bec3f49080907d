"""The OpenAI-compatible HTTP app (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (``?verbose=1``: the doctor's findings), ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``. Every error is OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}`` with the matching status.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from qpage.engine.engine import LLMEngine
from qpage.server import doctor
from qpage.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from qpage.server.prometheus import render
from qpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qpage.server.serving import OpenAIServing, model_card

log = logging.getLogger("qpage.server")
Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]
OPEN_PATHS = ("/health",)


@dataclass
class ServerSettings:
    model_names: list[str]
    api_key: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    chat_template: str | None = None


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _send_json(send: Callable[[dict[str, Any]], Awaitable[None]], err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413 (the body is read and dropped, so
    the client gets the answer instead of a reset connection)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            size += len(msg.get("body", b""))
            more = msg.get("more_body", False)
            if size <= self.limit:
                chunks.append(msg.get("body", b""))
        if size > self.limit:
            return await _send_json(send, APIError(
                413, f"the request body is {size} bytes, over this server's limit of {self.limit}; "
                     "send a shorter prompt, or start the server with a larger --max-request-bytes"))
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: wait for the disconnect

        return await self.app(scope, replay, send)


class ApiKeyAuth:
    """With an API key set, every path but /health needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        # /health is open to load balancers; its verbose form shows internals and is not.
        if scope["path"] in OPEN_PATHS and b"verbose" not in scope.get("query_string", b""):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(token, self.key):
            what = "is missing" if not given and not headers.get(b"x-api-key") else "is wrong"
            return await _send_json(send, APIError(
                401, f"the API key {what}: send the server's key as 'Authorization: Bearer KEY'",
                code="invalid_api_key"))
        return await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errs):
        return "the request body is not valid JSON; send a JSON object", None
    parts, param = [], None
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or (loc or None)
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(APIError(503, str(exc), code="server_busy"))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(exc), code="engine_dead"))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("qpage: unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def build_app(aengine: AsyncEngine, settings: ServerSettings) -> Any:
    engine: LLMEngine = aengine.engine
    serving = OpenAIServing(aengine, settings.model_names, settings.chat_template)
    created = int(time.time())
    name = settings.model_names[0]
    cfg = engine.config
    config_info = {"max_num_seqs": cfg.scheduler.max_num_seqs, "max_num_batched_tokens":
                   cfg.scheduler.max_num_batched_tokens, "kv_cache_dtype": cfg.cache.kv_cache_dtype,
                   "max_model_len": engine.max_model_len}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="qpage", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n, engine.max_model_len, created) for n in settings.model_names]}

    @app.get("/health")
    async def health(verbose: int = 0) -> Response:
        if not aengine.alive:
            return error_response(APIError(503, f"the engine has stopped: {aengine.error}", code="engine_dead"))
        if not verbose:
            return JSONResponse({"status": "ok"})
        before, after, seconds = await aengine.doctor_samples()
        info = {**config_info, **await aengine.call(lambda e: e.kernel_paths())}
        findings = doctor.diagnose(before, after, seconds, info)
        return JSONResponse({"status": "ok", "findings": [f.as_dict() for f in findings]})

    @app.get("/metrics")
    async def metrics() -> Response:
        snap, kernels = await aengine.call(lambda e: (e.get_metrics(), e.kernel_paths()))
        return Response(render(snap, kernels, name, config_info),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text, special = await serving.render_chat(body.messages, body.add_generation_prompt), False
        else:
            text, special = body.prompt, body.add_special_tokens
        ids = await aengine.call(lambda e: e.tokenizer.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = engine.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await aengine.call(lambda e: e.tokenizer.decode(body.tokens))}

    wrapped: Any = app
    if settings.api_key:
        wrapped = ApiKeyAuth(wrapped, settings.api_key)
    return BodyLimit(wrapped, settings.max_request_bytes)
