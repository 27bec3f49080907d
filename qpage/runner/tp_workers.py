"""Tensor-parallel ranks as processes. Rank 0 is the engine's own process (the driver: it
schedules, samples and detokenizes, and holds its part of the model); ranks 1..N-1 are
workers that hold theirs and follow the driver's commands: ``("step", StepInputs)``,
``("calibrate", token ids)``, and None to stop.

``LLM(tensor_parallel_size=N)`` spawns the workers and joins them over TCP on 127.0.0.1.
Under ``torchrun`` (RANK and WORLD_SIZE set) every process runs the same command; rank 0
goes on as the driver, the others serve as workers (in ``Workers()``) and exit when it stops.
A rank that dies or hangs surfaces in the driver's next collective (connection reset, or the
group's timeout) and becomes a ``TensorParallelError`` naming the spawned rank or the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu.matmul import blas
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.kv_layout import KVLayout
from qpage.models.arch import ArchConfig
from qpage.models.loader import load_model
from qpage.models.sharding import Rank, plan_shards
from qpage.parallel.comm import Collectives, TensorParallelError
from qpage.runner.model_runner import ModelRunner
from qpage.runner.sampler import Sampler

log = logging.getLogger("qpage")


@dataclass
class RankSetup:
    """What every rank builds its part from, decided once by the driver."""

    model_dir: Path
    arch: ArchConfig
    dtype: torch.dtype
    device: str
    max_model_len: int
    num_blocks: int
    kv_spec: KVCacheSpec
    attention_backend: str
    allow_pickle: bool
    dequantize_weights: bool
    kv_layout: KVLayout | None = None
    """Groups of layers sharing block tables (``layers.attention.kv_layout``); None: one group."""


@dataclass
class RankReport:
    """What a rank holds once built (the start line; None error) or why it failed."""

    rank: int
    weight_bytes: int = 0
    kv_bytes: int = 0
    kv_heads: int = 0
    error: str | None = None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this process holds: each linear's and the embedding's on its kernel
    path (a tied head's packed copy of the embedding included), plus the norms."""
    total = 0
    for m in model.modules():
        if hasattr(m, "kernel_path"):
            total += int(m.weight_bytes)
        else:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def _pin(rank: int, world: int, device: str) -> Callable[[], None]:
    """On CPU, give each rank its share of this process's cores (one pool of threads per
    core, none spinning on another rank's), and size the thread pools to it. Returns what
    undoes it (the driver's process outlives its engine)."""
    if device != "cpu" or not hasattr(os, "sched_setaffinity"):
        return lambda: None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return lambda: None
    threads = torch.get_num_threads()
    mine = cores[rank * len(cores) // world : (rank + 1) * len(cores) // world]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    blas.set_threads(len(mine))

    def undo() -> None:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        blas.set_threads(None)

    return undo


def build_rank(setup: RankSetup, comm: Collectives, sampler: Sampler | None = None,
               broadcast: Callable[[Any], None] | None = None) -> tuple[ModelRunner, RankReport]:
    """This rank's part of the model and of the KV cache (the driver passes its sampler and,
    with workers, how it sends them commands). Every engine builds here: a model that is not
    split is a world of one (``Collectives.solo``), which holds the whole model."""
    rank = Rank(plan_shards(setup.arch, comm.world), setup.arch, comm)
    device = torch.device(rank_device(setup.device, comm.world, comm.rank))
    model = load_model(setup.model_dir, setup.arch, setup.dtype, device, setup.max_model_len,
                       setup.allow_pickle, setup.dequantize_weights, rank if comm.world > 1 else None)
    local = rank.plan.local_arch(setup.arch)
    runner = ModelRunner(model, local, setup.num_blocks, setup.dtype, device, kv_spec=setup.kv_spec,
                         attention_backend=setup.attention_backend, sampler=sampler, broadcast=broadcast,
                         kv_layout=setup.kv_layout)
    kv = setup.kv_spec.bytes_per_token(runner.layout.slots, local.num_kv_heads, local.head_dim)
    return runner, RankReport(comm.rank, weight_bytes(model), kv * setup.num_blocks * BLOCK_SIZE, local.num_kv_heads)


def serve(comm: Collectives) -> int:
    """A worker's life: build its part, report, then run the driver's commands until None.
    Returns the process's exit status (1: its part failed to load)."""
    setup: RankSetup = comm.broadcast()
    try:
        runner, report = build_rank(setup, comm)
    except Exception as e:  # reported to the driver, which raises it
        comm.gather_objects(RankReport(comm.rank, error=f"{type(e).__name__}: {e}"))
        return 1
    comm.gather_objects(report)
    while True:
        try:
            cmd = comm.broadcast()
        except RuntimeError:  # rank 0 is gone without a word: its own exit status tells why
            log.warning("qpage: rank %d: rank 0 closed the tensor-parallel group; stopping", comm.rank)
            return 0
        if cmd is None:
            return 0
        kind, arg = cmd
        if kind == "step":
            runner.run(arg)
        elif kind == "calibrate":
            runner.calibrate_kv_shifts(arg)


def _worker(rank: int, world: int, port: int, timeout_s: float, device: str) -> None:
    """Entry point of a spawned worker: it checks in on the driver's store, then joins."""
    _pin(rank, world, device)
    rank_device(device, world, rank)  # selects this rank's card before NCCL starts
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    store.set(_ready(rank), "1")
    comm = Collectives.join(rank, world, store, timeout_s, _backend(device))
    try:
        status = serve(comm)
    finally:
        comm.leave()
    sys.exit(status)


def _ready(rank: int) -> str:
    """The store key a spawned worker sets once it runs."""
    return f"qpage/ready/{rank}"


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device(device: str, world: int, rank: int) -> str:
    """This rank's device: the one asked for with one rank; on CUDA with several, the card of
    its local rank (torchrun's LOCAL_RANK, else its rank), checked to exist and selected."""
    if not device.startswith("cuda") or (world == 1 and not launched_by_torchrun()):
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.device_count() <= local:
        raise ValueError(f"tensor_parallel_size={world} puts rank {rank} on cuda:{local}, but this machine has "
                         f"{torch.cuda.device_count()} CUDA devices; use at most that many ranks per machine")
    torch.cuda.set_device(local)
    return f"cuda:{local}"


class Workers:
    """The driver's side of the group: rank 0's collectives and the worker processes."""

    def __init__(self, world: int, timeout_s: float, device: str) -> None:
        self.world, self.timeout_s = world, timeout_s
        self.procs: list[BaseProcess] = []
        self._unpin: Callable[[], None] = lambda: None
        self.external = launched_by_torchrun()
        """Ranks started by torchrun (else spawned here)."""
        if self.external:
            n = int(os.environ["WORLD_SIZE"])
            if n != world:
                raise ValueError(f"torchrun started {n} processes but tensor_parallel_size={world}; give the same "
                                 "number to both")
            rank = int(os.environ["RANK"])
            self._unpin = _pin(int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", n)),
                               device)
            self.comm = Collectives.join(rank, world, "env://", timeout_s, _backend(device))
            if rank != 0:  # a worker for the whole life of this process
                try:
                    status = serve(self.comm)
                finally:
                    self.comm.leave()
                sys.exit(status)
            return
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(target=_worker, args=(r, world, port, timeout_s, device), daemon=True,
                            name=f"qpage-tp-rank{r}")
            p.start()
            self.procs.append(p)
        self._unpin = _pin(0, world, device)
        try:
            self._await_workers(store)
            self.comm = Collectives.join(0, world, store, timeout_s, _backend(device))
        except TensorParallelError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise TensorParallelError(f"the tensor-parallel workers did not join: {e}") from e

    def _await_workers(self, store: dist.Store) -> None:
        """Wait for every spawned worker to check in, failing as soon as one exits first (an
        error at its start, printed above) or after the timeout."""
        keys = [_ready(r) for r in range(1, self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            dead = [f"rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}" for i, p in enumerate(self.procs)
                    if p.exitcode is not None]
            if dead:
                raise TensorParallelError(f"a tensor-parallel worker stopped before it joined: {'; '.join(dead)} "
                                          "(its error is printed above)")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel workers did not start within {self.timeout_s:g} s "
                                          "(distributed_timeout)")
            time.sleep(0.05)

    def send(self, cmd: Any) -> None:
        if not hasattr(self, "comm"):
            raise TensorParallelError("the tensor-parallel group stopped after an earlier error; start a new engine")
        self.comm.broadcast(cmd, self.timeout_s)

    def failure(self, e: BaseException) -> TensorParallelError:
        """The error to raise for a failed collective: which rank is gone, or the timeout."""
        for p in self.procs:  # a rank killed a moment ago may not have been reaped yet
            p.join(timeout=1)
        dead = [f"rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}" for i, p in enumerate(self.procs)
                if p.exitcode is not None]
        text = str(e).lower()
        if dead:
            why = "; ".join(dead)
        elif "timed out" in text:
            why = f"a rank did not answer within {self.timeout_s:g} s (distributed_timeout)"
        elif "connection" in text or "peer" in text:
            why = "a rank's connection broke"
        else:  # the ranks may be out of step after this: the group cannot go on
            why = "rank 0 failed inside a step"
        self.close(force=True)
        return TensorParallelError(f"tensor-parallel group failed: {why} ({type(e).__name__}: {e})")

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely unless ``force``, and by force if they do not stop) and leave."""
        alive = [p for p in self.procs if p.exitcode is None]
        if (alive or self.external) and hasattr(self, "comm") and not force:
            try:
                self.comm.broadcast(None, self.timeout_s)
            except Exception:  # the group is already broken; the workers are killed below
                log.debug("could not tell the tensor-parallel workers to stop", exc_info=True)
        for p in self.procs:
            p.join(timeout=0 if force else 5)
            if p.exitcode is None:
                p.kill()
                p.join()
        self.procs = []
        if hasattr(self, "comm"):
            self.comm.leave()
            del self.comm
        self._unpin()
        self._unpin = lambda: None
