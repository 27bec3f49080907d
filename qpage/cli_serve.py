"""``qpage serve``, ``qpage plan`` and ``qpage doctor``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from qpage.config import parse_size
from qpage.plan import DEFAULT_OVERHEAD, bundled_configs

COMMANDS = ("serve", "plan", "doctor")


def add_parsers(sub: Any, engine_args: Any) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="model folder or .gguf file (default: the default model); same as --model")
    engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("QPAGE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or 'X-API-Key: KEY') on every endpoint but "
                        "/health (default: $QPAGE_API_KEY, else none)")
    s.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) clients send (default: the model folder's name)")
    s.add_argument("--max-waiting", type=_positive_int, default=1024,
                   help="most sequences (prompts x n) waiting for the engine: past it a request gets 503 with "
                        "Retry-After, and a request larger than the whole bound 400 (default: 1024)")
    s.add_argument("--max-n", type=_positive_int, default=16,
                   help="most completions (n) one request may ask for; 400 past it (default: 16)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=4 * 1024 * 1024,
                   help="largest request body (413 past it; default: 4 MiB)")
    s.add_argument("--read-timeout", type=_positive_seconds, default=30.0,
                   help="seconds a client has to send a request's head, and again its body; the connection "
                        "is closed (head) or answered 408 (body) past it (default: 30)")
    s.add_argument("--max-connections", type=_positive_int, default=512,
                   help="most open connections; requests past it get 503 (default: 512)")
    s.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)")
    s.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in chat messages (e.g. <|im_start|>) as control tokens; "
                        "only for trusted clients, who could otherwise write turns of other roles (default: "
                        "they are plain text)")
    s.add_argument("--grammar-compile-timeout", type=_positive_seconds, default=10.0,
                   help="seconds one structured-output grammar may take to compile; past it the compile "
                        "process is killed and the request gets 400 (default: 10)")
    s.add_argument("--grammar-compile-memory", default="1GiB",
                   help="memory the grammar compile process may allocate (default: 1GiB)")
    s.add_argument("--grammar-cache-memory", default="256MiB",
                   help="compiled grammars kept for reuse, least recently used dropped first (default: 256MiB)")
    s.add_argument("--log-interval", type=float, default=5.0, help="seconds between stats log lines")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)

    p = sub.add_parser("plan", help="what fits on one card: weights x KV dtype -> tokens and concurrent requests")
    p.add_argument("model", help=f"config.json, model folder, or a bundled config: {', '.join(bundled_configs())}")
    p.add_argument("--gpu-memory", default="24GiB", help="card memory (default: 24GiB)")
    p.add_argument("--overhead", default=DEFAULT_OVERHEAD, help="memory kept for activations and runtime")
    p.add_argument("--context-len", type=int, default=None, help="tokens per request (default: min(8192, model limit))")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="cards the model is split over; the figures are per card (default: 1)")
    p.add_argument("--full-kv-cache", action="store_true",
                   help="plan as if sliding-window layers kept every token (the saving of their windowed cache)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")

    d = sub.add_parser("doctor", help="explain a slow server from its /metrics")
    d.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    d.add_argument("--api-key", default=os.environ.get("QPAGE_API_KEY"))
    d.add_argument("--interval", type=float, default=10.0, help="seconds between the two samples")
    d.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace, build_engine_config: Any) -> int:
    try:
        if args.command == "plan":
            from qpage.plan import run_plan

            print(run_plan(args.model, args.gpu_memory, args.overhead, args.context_len, args.json,
                           args.tensor_parallel_size, not args.full_kv_cache))
            return 0
        if args.command == "doctor":
            return _doctor(args)
        return _serve(args, build_engine_config)
    except (ValueError, FileNotFoundError) as e:
        print(f"qpage {args.command}: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace, build_engine_config: Any) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(f"`qpage serve` needs the server extras ({e.name} is missing): "
                         "pip install 'qpage[server]'") from None

    from qpage.engine.engine import LLMEngine
    from qpage.server.app import ServerSettings, build_app
    from qpage.server.async_engine import AsyncEngine
    from qpage.server.middleware import TimedH11Protocol

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_path is not None:
        args.model = args.model_path
    config = build_engine_config(args)
    engine = LLMEngine(config)
    names = args.served_model_name or [_default_name(engine, args.model)]
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    aengine = AsyncEngine(engine, args.max_waiting, args.log_interval)
    app = build_app(aengine, ServerSettings(names, args.api_key, args.max_request_bytes, template, args.max_n,
                                            args.read_timeout, args.special_tokens_in_content,
                                            args.grammar_compile_timeout,
                                            parse_size(args.grammar_compile_memory, "--grammar-compile-memory"),
                                            parse_size(args.grammar_cache_memory, "--grammar-cache-memory")))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("qpage.server").warning(
            "serving on %s without --api-key: anyone who can reach this port can use the model", args.host)
    logging.getLogger("qpage.server").info("serving %s on http://%s:%d/v1", ", ".join(names), args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
        timeout_graceful_shutdown=5, http=TimedH11Protocol.with_timeout(args.read_timeout),
        limit_concurrency=args.max_connections))
    aengine.on_fatal = lambda: setattr(server, "should_exit", True)  # requests in flight got their 503 first
    try:
        server.run()
    finally:  # the engine thread may still be inside a step (it was given 10 s): then no polite stop
        engine.shutdown(force=aengine.running)
    if aengine.error is not None:
        print(f"qpage serve: error: the engine stopped: {aengine.error}", file=sys.stderr)
        return 1
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _default_name(engine: Any, model: str | None) -> str:
    from qpage.formats.gguf import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if model is None else engine.model_dir.name


def _scrape(url: str, key: str | None) -> str:
    req = urllib.request.Request(url.rstrip("/") + "/metrics")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        raise ValueError(f"{url}/metrics answered {e.code}: {e.read().decode()[:200]}") from None
    except OSError as e:
        raise ValueError(f"could not reach {url}/metrics ({e}); is `qpage serve` running there?") from None


def _doctor(args: argparse.Namespace) -> int:
    from qpage.server.doctor import diagnose, parse_prometheus, report

    before, _ = parse_prometheus(_scrape(args.url, args.api_key))
    t0 = time.monotonic()
    print(f"qpage doctor: sampling {args.url}/metrics for {args.interval:.0f}s ...", file=sys.stderr)
    time.sleep(args.interval)
    after, info = parse_prometheus(_scrape(args.url, args.api_key))
    findings = diagnose(before, after, time.monotonic() - t0, info)
    print(json.dumps({"findings": [f.as_dict() for f in findings]}, indent=2) if args.json else report(findings))
    return 1 if any(f.status == "warn" for f in findings) else 0
