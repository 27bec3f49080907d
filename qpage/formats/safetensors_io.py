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
import os
import struct
from collections.abc import Collection, Iterator
from pathlib import Path

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


def iter_tensors(path: Path, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a file (or only ``names``), read into its own buffer (nothing stays mapped)."""
    header, base = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if names is not None and name not in names:
                continue
            begin, end = info["data_offsets"]
            buf = bytearray(end - begin)
            view, done = memoryview(buf), 0
            while done < len(buf):
                got = os.preadv(fd, [view[done:]], base + begin + done)
                if got <= 0:
                    raise ValueError(f"{path}: unexpected end of file in tensor {name!r}")
                done += got
            dtype = DTYPES[info["dtype"]]
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            yield name, t.view(info["shape"])
    finally:
        os.close(fd)


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
