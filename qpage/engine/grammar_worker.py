"""Grammar compiles in a child process that can be killed: a compile runs inside XGrammar's C++
code, which no thread can interrupt, and some constraints take minutes or gigabytes (nested
bounded repeats in a 30-character regex). The server compiles there; the offline API, whose
caller is the user's own code, compiles in its own process.

Protocol: the parent sends ``(kind, text, options)`` (``compile_source``'s arguments) over a
pipe; the child answers ``("ok", serialized grammar)`` or ``("error", message)``. The parent
waits in short polls, so that a time limit or a cancelled request kills the child at once; a
new child is started on the next compile. The child's data segment is capped (RLIMIT_DATA),
and it is restarted when its resident memory passes the same cap between compiles.
The child compiles with ``grammar_compile.compile_source``, so a new grammar's trial walk
runs under the same limits.
"""

from __future__ import annotations

import multiprocessing
import resource
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from qpage.engine.grammar_compile import compile_source

POLL_S = 0.05
STARTUP_S = 120
"""Most seconds a new child may take to import the library and read the vocabulary."""


class CompileStopped(ValueError):
    """The compile was ended: past its time limit, cancelled, or the child died (its message says which)."""


def _status_bytes(pid: int | str, field: str) -> int:
    """A ``/proc/PID/status`` size field (VmRSS, VmData) in bytes; 0 where there is none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(conn: Connection, memory_bytes: int) -> None:
    """The child's loop: read the tokenizer (the first message), then compile what arrives and
    answer with the serialized grammar (or the error) and how far its resident memory has
    grown since it started."""
    tokenizer_info = conn.recv()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    limit = _status_bytes("self", "VmData") + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    base = _status_bytes("self", "VmRSS")
    conn.send(("ready", "", 0))
    while True:
        try:
            kind, text, options = conn.recv()
        except EOFError:
            return
        try:
            answer = ("ok", compile_source(compiler, kind, text, options).serialize_json())
        except MemoryError:
            answer = ("error", f"compiling it needs more than {memory_bytes >> 20} MiB")
        except Exception as e:  # the library's errors are about the input
            answer = ("error", str(e))
        conn.send((*answer, _status_bytes("self", "VmRSS") - base))


class CompileWorker:
    """The child process and the limits it runs under; ``compile`` is called from one thread
    at a time (the server's compile thread)."""

    def __init__(self, tokenizer_info: str, time_limit_s: float, memory_bytes: int) -> None:
        self.tokenizer_info = tokenizer_info
        self.time_limit_s = time_limit_s
        self.memory_bytes = memory_bytes
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0

    def start(self) -> None:
        """Start the child now (it takes seconds: it imports the library and reads the vocabulary)."""
        self._start()

    def _start(self) -> tuple[Any, Connection]:
        if self._proc is None or not self._proc.is_alive():
            self.stop()
            ctx = multiprocessing.get_context("spawn")  # the server has threads: never fork it
            parent, child = ctx.Pipe()
            # the vocabulary goes over the pipe, not as an argument: spawn writes arguments to a
            # pipe whose read end it holds itself, so a child killed while starting would block it
            proc = ctx.Process(target=_child, args=(child, self.memory_bytes), daemon=True,
                               name="qpage-grammar-compile")
            try:
                proc.start()
            finally:
                child.close()
            self._proc, self._conn = proc, parent  # only a started child is kept
            parent.send(self.tokenizer_info)
            if not parent.poll(STARTUP_S):  # the time limit counts compiles, not the start
                raise OSError(f"the compile process did not start within {STARTUP_S} s")
            parent.recv()
        assert self._conn is not None
        return self._proc, self._conn

    def stop(self) -> None:
        """Kill the child, if there is one (a new one starts on the next compile)."""
        proc, conn = self._proc, self._conn
        self._proc, self._conn = None, None
        if proc is not None:
            proc.kill()
            proc.join(5)
            self.restarts += 1
        if conn is not None:
            conn.close()

    def compile(self, kind: str, text: str, options: dict[str, Any], cancel: threading.Event | None = None) -> str:
        """The serialized grammar; ValueError with the library's message, CompileStopped past the
        time limit, on ``cancel``, or if the child died."""
        try:
            proc, conn = self._start()
            conn.send((kind, text, options))
        except (OSError, EOFError) as e:  # the child died as it started, or before it read the job
            self.stop()
            raise CompileStopped(f"the compile process died ({e}); retry") from None
        deadline = time.monotonic() + self.time_limit_s
        while not conn.poll(POLL_S):
            why = ("it took longer than the compile time limit of "
                   f"{self.time_limit_s:g} s; simplify it" if time.monotonic() > deadline
                   else "its request was cancelled" if cancel is not None and cancel.is_set()
                   else f"the compile process died (exit code {proc.exitcode})" if not proc.is_alive() else None)
            if why is not None:
                self.stop()
                raise CompileStopped(why)
        try:
            status, payload, grown = conn.recv()
        except EOFError:
            self.stop()
            raise CompileStopped(f"the compile process died (exit code {proc.exitcode}); it may have run "
                                 f"out of its {self.memory_bytes >> 20} MiB") from None
        if grown > self.memory_bytes // 2:
            self.stop()  # what the library keeps after compiles is given back with the process
        if status != "ok":
            raise ValueError(payload)
        return payload
