"""The collectives a split model calls, over torch.distributed (gloo on CPU, NCCL on CUDA).

Two process groups: ``compute`` carries the collectives inside a step and has the bounded
timeout that turns a dead or hung rank into an error; ``control`` carries the driver's
commands, on which idle workers wait for as long as the engine idles.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SMALL = 1 << 16
"""Tensors of at most this many elements are all-reduced as an all-gather and a local sum."""
IDLE_TIMEOUT = datetime.timedelta(days=365)
"""How long a worker waits for the driver's next command (an idle server sends none)."""


@dataclass
class Collectives:
    """This process's rank in the tensor-parallel group and the operations between ranks."""

    rank: int
    world: int
    backend: str
    compute: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    comm_seconds: float = 0.0
    """Time spent in collectives inside steps (for the benchmarks)."""

    @classmethod
    def solo(cls) -> Collectives:
        """A world of one (a model that is not split): no group, and no layer calls a collective."""
        return cls(0, 1, "none", None, None)

    @classmethod
    def join(cls, rank: int, world: int, init: str | dist.Store, timeout_s: float,
             backend: str = "gloo") -> Collectives:
        """Join the group (``init``: ``env://``, or the store rank 0 serves)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        where = {"init_method": init} if isinstance(init, str) else {"store": init}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **where)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(rank, world, backend, dist.group.WORLD, control)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def broadcast(self, obj: Any = None, wait_s: float | None = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: commands and step inputs, between this
        group's own processes). ``wait_s`` bounds how long rank 0 waits for the others to take
        it (a gloo broadcast waits for every receiver); the workers wait for as long as it takes."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(dist.broadcast(size, 0, group=self.control, async_op=True), wait_s)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(
            int(size), dtype=torch.uint8)
        self._wait(dist.broadcast(buf, 0, group=self.control, async_op=True), wait_s)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    @staticmethod
    def _wait(work: Any, wait_s: float | None) -> None:
        if wait_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=wait_s))

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere), within the group's timeout."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.compute)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Small tensors (a decode step's rows) and any tensor on two
        ranks are all-gathered and summed here in rank order: gloo's all-reduce is a ring of
        two phases and took 1.7x as long as one all-gather for 576 floats on two CPU ranks; on
        two ranks both move the same bytes. Every rank adds in the same order, so all agree."""
        t = time.perf_counter()
        if self.backend == "gloo" and (self.world == 2 or x.numel() <= SMALL):
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.compute)
            total = parts[0]
            for p in parts[1:]:
                total += p
            x.copy_(total)
        else:
            dist.all_reduce(x, group=self.compute)
        self.comm_seconds += time.perf_counter() - t
        return x

    def all_gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """[rows, widths[rank]] on each rank -> [rows, sum(widths)], ranks in order (unequal
        widths are padded for the transfer)."""
        t = time.perf_counter()
        w = max(widths)
        x = x.contiguous() if x.shape[1] == w else torch.nn.functional.pad(x, (0, w - x.shape[1]))
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.compute)
        out = torch.cat([p[:, :n] for p, n in zip(parts, widths, strict=True)], dim=1)
        self.comm_seconds += time.perf_counter() - t
        return out

    def gather_cols(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Like ``all_gather_cols`` but the result only on rank 0 (logits)."""
        t = time.perf_counter()
        w = max(widths)
        x = x.contiguous() if x.shape[1] == w else torch.nn.functional.pad(x, (0, w - x.shape[1]))
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.compute)
        self.comm_seconds += time.perf_counter() - t
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, widths, strict=True)], dim=1)


class TensorParallelError(RuntimeError):
    """A rank died, hung past the timeout, or failed to load: the group cannot go on (the
    engine stops; a server answers 503 and exits)."""
