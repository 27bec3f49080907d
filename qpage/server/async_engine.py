"""One engine, many concurrent requests: the step loop on its own thread, asyncio in front.

The engine is not thread-safe, so everything that touches it (adding and aborting requests,
reading metrics) runs on the engine thread as a command between two steps; the asyncio side
awaits the result. Prompts arrive already tokenized (``server.preprocess``), so the thread
runs model work and per-token output processing only. Each request gets a stream: the
engine thread pushes a snapshot after every step that touched the request, the HTTP handler
reads them. A stream closed early (client gone, handler cancelled) aborts its request at
once, which frees its KV blocks before the next step. A request the engine failed on alone
gets ``RequestFailedError`` in its stream; the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from qpage.engine.engine import LLMEngine, PromptType
from qpage.engine.outputs import RequestOutput, SampleLogprobs
from qpage.parallel.comm import TensorParallelError
from qpage.sampling_params import SamplingParams

log = logging.getLogger("qpage.server")
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue has no room for the request's sequences now (HTTP 503, retry later)."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone; the others went on (HTTP 500 for its client,
    400 when the request itself is at fault)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (HTTP 503)."""


@dataclass(frozen=True)
class CompletionSnap:
    """One completion as it stands after a step. ``text`` is what is safe to show: while the
    completion runs, a tail that could still turn into a stop string is held back."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class Snapshot:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionSnap]
    finished: bool


class RequestStream:
    """The snapshots of one request, in order; ``close()`` aborts it if still running."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._owner = owner
        self.loop = loop
        self._queue: asyncio.Queue[Snapshot | BaseException | None] = asyncio.Queue()
        self.request_id = ""
        self.finished = False
        self.closed = False

    def put_threadsafe(self, item: Snapshot | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def put(self, item: Snapshot | BaseException) -> None:
        """On the event loop."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Snapshot:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:  # aborted
            self.closed = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent, callable from the loop."""
        if not self.finished and not self.closed:
            self.closed = True
            self._owner.abort(self.request_id)
        self._queue.put_nowait(None)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, log_interval: float = 5.0) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        """Called once when the engine thread stops on an error (the server then exits)."""
        self._last_log = (time.monotonic(), 0, 0, 0, 0)
        self.history: deque[tuple[float, dict[str, Any]]] = deque(maxlen=64)
        """(time, metrics snapshot) every ``log_interval`` seconds, for the doctor."""

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="qpage-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def running(self) -> bool:
        """Whether the engine thread is still running (a step may be in progress)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---------------------------------------------------------------- asyncio side
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; return or raise its result."""
        if not self.alive:
            raise EngineDeadError(f"the engine has stopped: {self.error or 'not started'}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                res = fn(self.engine)
            except BaseException as e:  # handed back to the caller
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, res)

        self._cmds.put(run)
        return await fut

    async def generate(
        self, prompts: list[PromptType], params: SamplingParams, request_id: str, add_special_tokens: bool = True,
        grammar: Any = None,
    ) -> list[RequestStream]:
        """Queue one request's prompts together (ids ``request_id`` or ``request_id-i``), or none
        of them: raise ValueError (bad input) or QueueFullError before any starts. The queue
        bound counts sequences: every prompt runs ``params.n`` of them. ``grammar`` is
        ``params.structured_outputs`` compiled off the engine thread (``LLMEngine.add_request``)."""
        loop = asyncio.get_running_loop()
        rids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [RequestStream(self, loop) for _ in prompts]
        for rid, stream in zip(rids, streams, strict=True):
            stream.request_id = rid
        seqs = len(prompts) * params.n

        def add(engine: LLMEngine) -> None:
            waiting = len(engine.scheduler.waiting)
            if self.max_waiting is not None and waiting + seqs > self.max_waiting:
                raise QueueFullError(
                    f"the server is at capacity ({waiting} sequences waiting, bound {self.max_waiting}; this "
                    f"request adds {seqs}); retry later"
                )
            added: list[str] = []
            try:
                for rid, p in zip(rids, prompts, strict=True):
                    added.append(engine.add_request(p, params, request_id=rid, add_special_tokens=add_special_tokens,
                                                    grammar=grammar))
            except BaseException:
                for rid in added:  # all or nothing
                    engine.abort_request(rid)
                raise
            for rid, stream in zip(rids, streams, strict=True):
                self._streams[rid] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:  # the handler went away: whatever was added is aborted
            for stream in streams:
                stream.close()
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Abort from any thread; takes effect before the next step."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._cmds.put(run)

    async def doctor_samples(self, window: float = 60.0) -> tuple[dict[str, Any], dict[str, Any], float]:
        """(earlier snapshot, current snapshot, seconds between) for the doctor."""

        def take(engine: LLMEngine) -> tuple[dict[str, Any], dict[str, Any], float]:
            now = time.monotonic()
            cur = engine.get_metrics()
            old = [(t, snap) for t, snap in self.history if now - t <= window]
            t0, first = old[0] if old else (now, cur)
            return first, cur, now - t0

        return await self.call(take)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._maybe_log()
        except BaseException as e:  # the loop itself failed: report it through /health
            self.error = f"{type(e).__name__}: {e}"
            log.error("qpage engine thread stopped:\n%s", traceback.format_exc())
            for s in list(self._streams.values()):
                s.put_threadsafe(EngineDeadError(self.error))
            self._streams.clear()
            if self.on_fatal is not None:
                self.on_fatal()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=min(self.log_interval, 1.0)) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except TensorParallelError:
            raise  # a rank is gone: the engine cannot go on (the loop stops, /health answers 503)
        except Exception as e:
            # A step that failed outside any one request's part (the model forward) is not any
            # request's fault, and its state is unknown: end every request with the error, drop
            # the prefix cache (blocks it allocated may be half written) and go on with new ones.
            log.error("qpage: engine step failed; aborting %d requests:\n%s", len(self._streams),
                      traceback.format_exc())
            for rid, s in list(self._streams.items()):
                self.engine.abort_request(rid)
                s.put_threadsafe(RequestFailedError(f"the engine failed while running this request: {e}"))
            self._streams.clear()
            if not self.engine.kv.reset_prefix_cache():
                log.error("qpage: blocks still in use after a failed step; the prefix cache was kept")
            return
        batch: list[tuple[RequestStream, Snapshot | BaseException]] = []
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = self._snapshot(out) if out.error is None else RequestFailedError(
                f"the engine ended this request (other requests were not affected): {out.error}",
                400 if out.client_error else 500)
            batch.append((stream, item))
            if out.finished:
                del self._streams[out.request_id]
        if batch:  # one wake-up of the event loop per step, not one per request
            batch[0][0].loop.call_soon_threadsafe(_deliver, batch)

    def _snapshot(self, out: RequestOutput) -> Snapshot:
        parent = self.engine.outputs.parents.get(out.request_id)
        comps = []
        for i, c in enumerate(out.outputs):
            text = c.text
            if c.finish_reason is None and parent is not None and parent.detoks[i] is not None:
                text = parent.detoks[i].stable_text(False)  # type: ignore[union-attr]
            comps.append(CompletionSnap(
                c.index, text, list(c.token_ids), None if c.logprobs is None else list(c.logprobs),
                c.cumulative_logprob, c.finish_reason, c.stop_reason,
            ))
        return Snapshot(out.request_id, out.prompt_token_ids, comps, out.finished)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        t0, p0, g0, q0, h0 = self._last_log
        if now - t0 < self.log_interval:
            return
        m = self.engine.metrics
        self.engine.update_gauges()
        p, g = m.counters["prompt_tokens_total"], m.counters["generation_tokens_total"]
        q, h = m.counters["prefix_cache_queries"], m.counters["prefix_cache_hits"]
        self._last_log = (now, p, g, q, h)
        self.history.append((now, self.engine.get_metrics()))
        running, waiting = m.gauges["num_requests_running"], m.gauges["num_requests_waiting"]
        if p == p0 and g == g0 and not running and not waiting:
            return  # idle: say nothing
        dt = now - t0
        hit = 100.0 * (h - h0) / (q - q0) if q > q0 else 0.0
        log.info(
            "running %d, waiting %d, KV cache %.1f%%, prompt %.1f tok/s, generation %.1f tok/s, "
            "prefix cache hit %.1f%%, preemptions %d",
            running, waiting, 100.0 * m.gauges["kv_cache_usage_perc"], (p - p0) / dt, (g - g0) / dt, hit,
            m.counters["num_preemptions_total"],
        )


def _deliver(batch: list[tuple[RequestStream, Snapshot | BaseException]]) -> None:
    for stream, snap in batch:
        stream.put(snap)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
