"""Reading and writing safetensors one tensor at a time, for bounded memory.

``safe_open`` maps the whole file: every tensor read stays resident (and counts in RSS)
until the file is closed, so walking a 1 GB shard costs 1 GB. ``save_file`` serializes a
shard into one bytes object before writing it. The quantizer needs neither: it reads each
tensor with a positioned read into its own buffer and writes each shard from a list of
tensors, one tensor's bytes at a time. The format (8-byte little-endian header length, a
JSON header of dtype / shape / data_offsets, then the data) is read the same way safetensors
reads it; no pickle anywhere.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, offset of the data section); clear errors on bad files."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = struct.unpack("<Q", raw)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path}: the safetensors header is not valid JSON; the file is corrupt") from None
    header.pop("__metadata__", None)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES or end > size - 8 - n or begin > end:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file or has an unknown dtype "
                             f"{info['dtype']!r}; the file is truncated or corrupt")
    return header, 8 + n


def _pread(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{path}: unexpected end of file in tensor {name!r}")
        done += got


def _tensor(buf: bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return (torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)).view(shape)


def iter_tensors(path: Path, names: Collection[str] | None = None,
                 transient: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a file (or only ``names``), read into its own buffer (nothing stays
    mapped). Tensors whose name ``transient`` accepts share one reused buffer instead, valid
    only until the next tensor is read: for a consumer that is done with each before asking
    for the next, it saves faulting in fresh memory for every tensor (reading into memory
    already touched measured about five times faster)."""
    header, base = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    scratch = torch.empty(0, dtype=torch.uint8)
    try:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if names is not None and name not in names:
                continue
            begin, end = info["data_offsets"]
            if transient is not None and transient(name):
                if scratch.numel() < end - begin:
                    scratch = torch.empty(end - begin, dtype=torch.uint8)
                buf = scratch[: end - begin]
            else:
                buf = torch.empty(end - begin, dtype=torch.uint8)  # not zero-filled: the read fills it
            _pread(fd, memoryview(buf.numpy()), base + begin, path, name)
            yield name, buf.view(DTYPES[info["dtype"]]).view(info["shape"])
    finally:
        os.close(fd)


class LazyTensor:
    """A tensor of a safetensors file not read yet: ``t[a:b]`` reads only rows [a, b),
    ``t[:, a:b]`` only those columns of each row (a positioned read per row), ``read()`` all
    of it. What a tensor-parallel rank reads its slices with."""

    def __init__(self, path: Path, name: str, info: dict, base: int) -> None:
        self.path, self.name = path, name
        self.dtype: torch.dtype = DTYPES[info["dtype"]]
        self.shape = tuple(info["shape"])
        self._offset = base + info["data_offsets"][0]

    def read(self) -> torch.Tensor:
        return self[:] if self.shape else self._read(self._offset, self.dtype.itemsize, 1, 0, [])

    def __getitem__(self, index: slice | tuple[slice, slice]) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        whole_rows = cols == slice(None)
        if not (self.shape and isinstance(rows, slice) and isinstance(cols, slice) and rows.step in (None, 1)
                and cols.step in (None, 1) and (whole_rows or len(self.shape) == 2)):
            raise TypeError(f"{self.name}: a lazy tensor of shape {self.shape} reads [a:b] or [:, a:b], not {index!r}")
        r0, r1, _ = rows.indices(self.shape[0])
        r1 = max(r0, r1)
        es = self.dtype.itemsize
        row = math.prod(self.shape[1:]) * es
        if whole_rows:
            return self._read(self._offset + r0 * row, (r1 - r0) * row, 1, 0, [r1 - r0, *self.shape[1:]])
        c0, c1, _ = cols.indices(self.shape[1])
        c1 = max(c0, c1)
        return self._read(self._offset + r0 * row + c0 * es, (c1 - c0) * es, r1 - r0, row, [r1 - r0, c1 - c0])

    def _read(self, offset: int, nbytes: int, count: int, stride: int, shape: list[int]) -> torch.Tensor:
        """``count`` runs of ``nbytes``, ``stride`` bytes apart from ``offset``, as one tensor."""
        buf = bytearray(nbytes * count)
        view = memoryview(buf)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in range(count):
                _pread(fd, view[i * nbytes : (i + 1) * nbytes], offset + i * stride, self.path, self.name)
        finally:
            os.close(fd)
        return _tensor(buf, self.dtype, shape)


def read_parts(parts: dict[str, Any], keep: Collection[str] = ()) -> dict[str, Any]:
    """``parts`` with every ``LazyTensor`` read, but those named in ``keep``."""
    return {k: v.read() if isinstance(v, LazyTensor) and k not in keep else v for k, v in parts.items()}


def lazy_tensors(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    """Each tensor of a file, not read yet (``LazyTensor``), in file order."""
    header, base = read_header(path)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        yield name, LazyTensor(path, name, info, base)


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written tensor by tensor (no whole-shard copy in memory)."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
