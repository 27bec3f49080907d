"""The OpenAI-compatible HTTP app (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (``?verbose=1``: the doctor's findings), ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``. Every error is OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}`` with the matching status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from qpage.config import BLOCK_SIZE
from qpage.engine.engine import LLMEngine
from qpage.server import doctor
from qpage.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError
from qpage.server.middleware import RETRY_AFTER_S, ApiKeyAuth, ErrorBoundary, RequestReader
from qpage.server.preprocess import Preprocessor
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


@dataclass
class ServerSettings:
    model_names: list[str]
    api_key: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    chat_template: str | None = None
    max_n: int = 16
    """Most completions (``n``) one request may ask for (400 past it)."""
    read_timeout: float = 30.0
    """Seconds a client has to send a request's head, and again its body (408 past it)."""
    special_tokens_in_content: bool = False
    """Let special-token strings in chat messages act as control tokens (trusted clients only)."""
    grammar_compile_timeout: float = 10.0
    """Seconds one grammar may take to compile (its compile process is killed past it: a 400)."""
    grammar_compile_memory: int = 1 << 30
    """Bytes the compile process may allocate (restarted when it holds half of it)."""
    grammar_cache_memory: int = 256 << 20
    """Bytes of compiled grammars kept for reuse, least recently used dropped first."""


def error_response(err: APIError, close: bool = False, headers: dict[str, str] | None = None) -> JSONResponse:
    extra = {**(headers or {}), **({"Connection": "close"} if close else {})}
    return JSONResponse(err.body(), status_code=err.status, headers=extra or None)


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's words
            detail = "the request body could not be parsed as JSON (nested too deeply?); send a plain JSON object"
        return error_response(APIError(exc.status_code, detail))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(APIError(503, str(exc), code="server_busy"), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(exc), code="engine_dead"))

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        if exc.status == 400:
            return error_response(APIError(400, str(exc), code="request_too_costly"))
        return error_response(APIError(500, str(exc), code="request_failed"), close=True)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("qpage: unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), close=True)


def _add_info_routes(app: FastAPI, aengine: AsyncEngine, pre: Preprocessor, serving: OpenAIServing,
                     config_info: dict[str, Any]) -> None:
    """/health, /metrics, /tokenize and /detokenize."""
    engine = aengine.engine
    name = serving.model_names[0]

    @app.api_route("/health", methods=["GET", "HEAD"])
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
            ids = await pre.chat_ids([m.as_template_dict() for m in body.messages], body.add_generation_prompt)
        else:
            ids = await pre.encode(body.prompt, body.add_special_tokens)  # type: ignore[arg-type]
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        return {"prompt": await pre.decode(body.tokens)}


def build_app(aengine: AsyncEngine, settings: ServerSettings) -> Any:
    engine: LLMEngine = aengine.engine
    engine.grammars.cache_bytes = settings.grammar_cache_memory
    engine.grammars.use_worker(settings.grammar_compile_timeout, settings.grammar_compile_memory)
    pre = Preprocessor(engine.tokenizer, engine.max_model_len, engine.arch.vocab_size, settings.chat_template,
                       engine.grammars, settings.special_tokens_in_content)
    serving = OpenAIServing(aengine, pre, settings.model_names, settings.max_n)
    created = int(time.time())
    cfg = engine.config
    config_info = {"max_num_seqs": cfg.scheduler.max_num_seqs, "max_num_batched_tokens":
                   cfg.scheduler.max_num_batched_tokens, "kv_cache_dtype": cfg.cache.kv_cache_dtype,
                   "kv_cache": engine.kv_spec.describe(), "kv_cache_tokens": engine.kv.num_blocks * BLOCK_SIZE,
                   "max_model_len": engine.max_model_len}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        if pre.compiles is not None:
            pre.compiles.start()
        yield
        aengine.shutdown()
        pre.shutdown()

    app = FastAPI(title="qpage", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n, engine.max_model_len, created) for n in settings.model_names]}

    _add_info_routes(app, aengine, pre, serving, config_info)
    wrapped: Any = RequestReader(ErrorBoundary(app), settings.max_request_bytes, settings.read_timeout)
    return ApiKeyAuth(wrapped, settings.api_key) if settings.api_key else wrapped
