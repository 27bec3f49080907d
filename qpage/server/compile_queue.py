"""The server's grammar compiles: one at a time on one thread (which drives the compile
process, ``engine/grammar_worker``), taken from the waiting clients in turn, so that one
client sending many costly schemas delays its own requests, not everyone's.

Bounds: ``MAX_PENDING_COMPILES`` compiles queued or running in all, ``MAX_CLIENT_COMPILES``
per client (its address); past either a constrained request gets 503 with ``Retry-After``. A
request whose client disconnects while it waits leaves the queue; one whose compile is
running has it killed (the compile process is restarted for the next one).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from qpage.engine.structured import GrammarCompiler
from qpage.sampling_params import StructuredOutputsParams
from qpage.server.protocol import APIError

MAX_PENDING_COMPILES = 8
"""Grammar compiles queued or running at once, for all clients."""
MAX_CLIENT_COMPILES = 2
"""Grammar compiles queued or running at once for one client."""
DISCONNECT_POLL_S = 0.25


@dataclass
class _Job:
    spec: StructuredOutputsParams
    client: str
    done: asyncio.Future[Any]
    cancel: threading.Event = field(default_factory=threading.Event)


class CompileQueue:
    def __init__(self, grammars: GrammarCompiler) -> None:
        self.grammars = grammars
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpage-grammar")
        self._waiting: dict[str, deque[_Job]] = {}  # per client, in arrival order
        self._served: dict[str, int] = {}  # per client: when its last compile started (a count)
        self._starts = 0
        self._running: _Job | None = None
        self._pending: dict[str, int] = {}  # per client: queued or running (event loop only)

    def start(self) -> None:
        """Start the compile process ahead of the first constrained request (it takes seconds)."""
        if self.grammars.worker is not None:
            self._pool.submit(self.grammars.worker.start)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars.worker is not None:
            self.grammars.worker.stop()

    async def compile(self, spec: StructuredOutputsParams, param: str, client: str,
                      disconnected: Callable[[], Awaitable[bool]]) -> Any:
        """``spec`` compiled; 400 naming ``param`` if it is invalid or past the compile limits,
        503 while the queue (or this client's share of it) is full."""
        total = sum(self._pending.values())
        if total >= MAX_PENDING_COMPILES:
            raise APIError(503, f"{total} grammars are waiting to compile; retry later", param, "server_busy")
        if self._pending.get(client, 0) >= MAX_CLIENT_COMPILES:
            raise APIError(503, f"this client already has {MAX_CLIENT_COMPILES} grammars compiling; retry when "
                                "they are done", param, "server_busy")
        job = _Job(spec, client, asyncio.get_running_loop().create_future())
        self._pending[client] = self._pending.get(client, 0) + 1
        self._waiting.setdefault(client, deque()).append(job)
        self._next()
        try:
            while not job.done.done():
                await asyncio.wait({job.done}, timeout=DISCONNECT_POLL_S)
                if not job.done.done() and await disconnected():
                    self._drop(job)
                    raise APIError(400, "the client disconnected while its grammar compiled", param)
            return job.done.result()
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        finally:
            self._pending[client] -= 1
            if not self._pending[client]:
                del self._pending[client]

    def _drop(self, job: _Job) -> None:
        """Take a job out of the queue, or stop its compile if it is running."""
        job.cancel.set()
        queue = self._waiting.get(job.client)
        if queue is not None and job in queue:
            queue.remove(job)
            if not queue:
                del self._waiting[job.client]

    def _next(self) -> None:
        """If nothing is compiling, start the oldest job of the client served least recently
        (event loop only)."""
        while self._running is None and self._waiting:
            client = min(self._waiting, key=lambda c: self._served.get(c, -1))
            queue = self._waiting[client]
            job = queue.popleft()
            if not queue:
                del self._waiting[client]
            if job.cancel.is_set():
                continue
            self._starts += 1
            self._served[client] = self._starts
            self._running = job
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self.grammars.compile, job.spec, job.cancel)
            fut.add_done_callback(lambda f, j=job: self._finished(j, f))  # type: ignore[misc]

    def _finished(self, job: _Job, fut: asyncio.Future[Any]) -> None:
        self._running = None
        self._served = {c: n for c, n in self._served.items() if c in self._waiting}  # only those waiting
        if not job.done.done() and not job.cancel.is_set():  # a cancelled job's client has left
            exc = fut.exception()
            if exc is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(fut.result())
        self._next()
