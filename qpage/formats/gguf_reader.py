"""A GGUF file's metadata and tensor table, with each tensor's bytes as a view of the
memory-mapped file (nothing is copied or converted here).

Layout (GGUF v2/v3, little-endian): the magic ``GGUF``, a uint32 version, uint64 tensor
and key counts; the metadata as (string key, uint32 type, value) entries; one entry per
tensor (string name, uint32 dims, uint64 sizes innermost first, uint32 ggml type, uint64
offset); then, aligned to ``general.alignment`` (default 32), the tensor data, each tensor at
its offset from there. Strings are a uint64 length and UTF-8 bytes.

Why not ``gguf.GGUFReader``: it builds a NumPy view per array element, which takes seconds
on a vocabulary of 50k tokens (the whole default model loads faster than that here). The
``gguf`` package still supplies the block sizes of every ggml type and the reference
dequantization.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = {F32: np.float32, F16: np.float16}
"""Types read as values rather than blocks (BF16 is read as uint16 bits)."""

# Metadata value types: fixed-size scalars by struct format; 8 is a string, 9 an array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_HEADERS: dict[tuple[str, int, int, bool], tuple[dict[str, Any], dict[str, TensorInfo]]] = {}
"""Parsed headers of the files read last, by (path, size, modification time, string arrays)."""


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    """Outermost first (torch order): a weight is [out_features, in_features]."""
    offset: int
    """Byte offset in the file."""
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(1, math.prod(self.shape))


@dataclass(frozen=True)
class SkippedStrings:
    """An array of strings left undecoded; ``len()`` is its length."""

    count: int

    def __len__(self) -> int:
        return self.count


class GgufFormatError(ValueError):
    """The file is not a GGUF qpage can read; the message names the file and the part."""


class GgufFile:
    """``metadata`` (key -> value: int, float, bool, str or list) and ``tensors`` (name ->
    ``TensorInfo``) of one file; ``data(name)`` returns a tensor's bytes as a read-only view."""

    def __init__(self, path: str | Path, string_arrays: bool = False) -> None:
        """``string_arrays``: decode arrays of strings (the vocabulary, the merges); without it
        they are ``SkippedStrings`` (their length only)."""
        self.path = Path(path)
        self._all_strings = string_arrays
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GgufFormatError(f"{self.path}: cannot map the file ({e})") from None
        self._pos = 0
        st = self.path.stat()
        key = (str(self.path.resolve()), st.st_size, st.st_mtime_ns, string_arrays)
        if key in _HEADERS:  # the same file read again (config, tokenizer, weights): reuse its header
            self.metadata, self.tensors = _HEADERS[key]
            return
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            if isinstance(e, GgufFormatError):
                raise
            raise GgufFormatError(f"{self.path}: truncated or corrupt GGUF header ({e}); re-download the file"
                                  ) from None
        _HEADERS[key] = (self.metadata, self.tensors)
        while len(_HEADERS) > 4:
            _HEADERS.pop(next(iter(_HEADERS)))

    # ---------------------------------------------------------------- parsing
    def _take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._take("<Q")
        if self._pos + n > len(self._map):
            raise struct.error(f"a string of {n} bytes runs past the end")
        s = bytes(self._map[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR:
            return self._take(_SCALAR[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GgufFormatError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos}")
        etype, count = self._take("<I"), self._take("<Q")
        if etype in _NUMPY:
            arr = np.frombuffer(self._map, dtype=_NUMPY[etype], count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        if etype == _STRING and not self._all_strings:
            return self._skip_strings(count)
        return [self._value(etype, key) for _ in range(count)]

    def _skip_strings(self, count: int) -> SkippedStrings:
        """Walk past ``count`` strings without decoding them (a vocabulary of 50k takes ~0.5 s
        to decode in Python and is read by the tokenizer builder on its own)."""
        buf, pos, size = self._map, self._pos, len(self._map)
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            if pos > size:
                raise struct.error("a string array runs past the end")
        self._pos = pos
        return SkippedStrings(count)

    def _parse(self) -> None:
        if bytes(self._map[:4]) != MAGIC:
            raise GgufFormatError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
        self._pos = 4
        version = self._take("<I")
        if version not in VERSIONS:
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise GgufFormatError(f"{self.path}: GGUF version {version}{hint}; qpage reads versions 2 and 3, "
                                  "re-convert the model with a current llama.cpp")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._take("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._take("<Q") for _ in range(self._take("<I"))]
            infos.append((name, dims, self._take("<I"), self._take("<Q")))
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise GgufFormatError(f"{self.path}: general.alignment is {align!r}; it must be a power of two")
        start = -(-self._pos // align) * align
        size = len(self._map)
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in GGML_QUANT_SIZES:
                raise GgufFormatError(f"{self.path}: tensor {name!r} has ggml type {ggml_type}, which qpage (and its "
                                      "gguf package) do not know; upgrade the gguf package or re-quantize the file")
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            count = math.prod(dims)
            if not dims or min(dims) <= 0 or len(dims) > 4:
                raise GgufFormatError(f"{self.path}: tensor {name!r} has dimensions {dims}; expected 1 to 4 sizes > 0")
            if dims[0] % block:
                raise GgufFormatError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole "
                                      f"{type_name(ggml_type)} blocks of {block}")
            info = TensorInfo(name, ggml_type, tuple(reversed(dims)), start + offset, count // block * nbytes)
            if info.offset + info.nbytes > size:
                raise GgufFormatError(f"{self.path}: tensor {name!r} ends at byte {info.offset + info.nbytes} but the "
                                      f"file has {size}: the file is truncated; re-download it")
            self.tensors[name] = info

    # ---------------------------------------------------------------- access
    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes: float tensors as values in their shape; block formats (and
        BF16) as uint8 [rows, bytes per row]."""
        t = self.tensors[name]
        if t.ggml_type in FLOAT_TYPES:
            count = math.prod(t.shape)
            return np.frombuffer(self._map, dtype=FLOAT_TYPES[t.ggml_type], count=count, offset=t.offset).reshape(
                t.shape)
        rows = math.prod(t.shape[:-1])
        raw = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.reshape(rows, t.nbytes // rows)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GgufFormatError(f"{self.path}: metadata key {key!r} is missing; the file was not written by a "
                                  "complete llama.cpp conversion")
        return self.metadata[key]
