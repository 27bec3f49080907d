"""``qpage quantize --format gguf``: a Hugging Face folder or a GGUF file in, a GGUF file that
llama.cpp loads out.

Tensors are read one at a time (from the safetensors shards, or dequantized from the source
file's blocks, so a Q8_0 or F16 file is requantized), put in llama.cpp's names and q/k row
order, quantized to the type ``gguf_write.tensor_type`` picks (``ggml_blocks``) and streamed
into the file. With calibration windows, each decoder linear's block scales are weighted by
its inputs' E[x^2], collected layer by layer with the layers before already quantized to
their GGUF types (``calibrate.calibrate_layers``); the embedding and output matrices, which
see no such inputs, are weighted by magnitude.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFValueType
from gguf.quants import dequantize

from qpage.formats.gguf_model import ARCHITECTURES, PERMUTED, GgufTensor, gguf_name, permute_rows, tensor_value
from qpage.formats.gguf_reader import GgufFile, type_name
from qpage.formats.gguf_write import (
    F16,
    F32,
    FILE_TYPES,
    GgufStream,
    Metadata,
    metadata_from_gguf,
    metadata_from_hf,
    tensor_type,
)
from qpage.formats.safetensors_io import LazyTensor, lazy_tensors
from qpage.models.loader import weight_files
from qpage.quantizers.calibrate import Parts, calibrate_layers
from qpage.quantizers.ggml_blocks import quantize_rows
from qpage.quantizers.gptq import gptq_ggml
from qpage.quantizers.pipeline import QuantizeReport, peak_rss, progress_bar

_QK = re.compile(r"^blk\.\d+\.attn_([qk])\.(weight|bias)$")


class _GgufSource:
    """Tensors of a GGUF file as fp32 in the file's own layout."""

    def __init__(self, path: Path, file_type: str) -> None:
        self.file = GgufFile(path)
        self.arch, self.metadata = metadata_from_gguf(path, file_type)
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{path}: architecture {self.arch!r} is not one qpage runs ({', '.join(ARCHITECTURES)})")
        self.n_layers = int(self.file.require(f"{self.arch}.block_count"))
        heads = int(self.file.require(f"{self.arch}.attention.head_count"))
        # q and k heads where the file keeps their rows in llama.cpp's rotary order
        self.heads = {"q": heads, "k": int(self.file.get(f"{self.arch}.attention.head_count_kv", heads))} \
            if self.arch in PERMUTED else {}
        self.tied = "output.weight" not in self.file.tensors
        self.entries = [(name, info.shape) for name, info in self.file.tensors.items()]
        self.bytes_in = path.stat().st_size

    def read(self, name: str) -> torch.Tensor:
        value = tensor_value(self.file, self.file.tensors[name])
        return value.dequantize() if isinstance(value, GgufTensor) else value


class _HfSource:
    """Tensors of a Hugging Face folder as fp32 under llama.cpp's names, q/k rows in its order."""

    def __init__(self, folder: Path, file_type: str) -> None:
        config = json.loads((folder / "config.json").read_text())
        if "quantization_config" in config:
            raise ValueError(f"{folder} is already quantized ({config['quantization_config'].get('quant_method')}); "
                             "write GGUF from the original checkpoint")
        self.arch, self.metadata = metadata_from_hf(folder, config, file_type)
        self.n_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        self.heads = {"q": heads, "k": int(config.get("num_key_value_heads", heads))}
        files = weight_files(folder, allow_pickle=False)
        self.lazy: dict[str, LazyTensor] = {}
        for f in files:
            for name, t in lazy_tensors(f):
                if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                self.lazy[gguf_name(name)] = t
        self.tied = "output.weight" not in self.lazy
        self.entries = [(name, t.shape) for name, t in self.lazy.items()]
        self.bytes_in = sum(f.stat().st_size for f in files)

    def read(self, name: str) -> torch.Tensor:
        t = self.lazy[name].read().float()
        rows = to_file_order(name, t.reshape(t.shape[0], -1).numpy(), self.heads)
        return torch.from_numpy(np.ascontiguousarray(rows)).reshape(t.shape)


def to_file_order(name: str, rows: np.ndarray, heads: dict[str, int]) -> np.ndarray:
    """Rows of tensor ``name`` in Hugging Face order -> the file's: q/k rows in llama.cpp's
    rotary order where ``heads`` names their head counts (whole rows, so blocks move as they are)."""
    m = _QK.match(name)
    return rows if m is None or m.group(1) not in heads else permute_rows(rows, heads[m.group(1)])


class _Calibrated:
    """Per GGUF tensor name, its inputs' E[x^2] (imatrix), or its blocks written by GPTQ and
    spilled to ``folder`` (``calibrate.ResultSink``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.importance: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, Path] = {}

    def put_layer(self, layer: int, results: dict[str, Any]) -> None:
        for name, value in results.items():
            if isinstance(value, np.ndarray):
                self.folder.mkdir(parents=True, exist_ok=True)
                self.blocks[name] = self.folder / f"{name}.npy"
                np.save(self.blocks[name], value)
            else:
                self.importance[name] = value


def quantize_gguf(src: Path, out: Path, file_type: str, calib: list[list[int]] | None = None,
                  calib_folder: Path | None = None, gptq: bool = False, progress: bool = True) -> QuantizeReport:
    """Write ``src`` (a GGUF file or a Hugging Face folder) as the GGUF file ``out`` of
    ``file_type`` (``FILE_TYPES``); ``calib`` token windows (run through ``calib_folder``, the
    source as a Hugging Face folder) weight the linears' block scales, or with ``gptq`` drive
    GPTQ's error feedback inside the blocks."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r} is not written; choose one of {', '.join(FILE_TYPES)}")
    if out.suffix.lower() != ".gguf":
        raise ValueError(f"{out}: a GGUF output is one file; give a path ending in .gguf")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output path or delete it first")
    if gptq and not calib:
        raise ValueError("GPTQ needs calibration text: pass --calib FILE (e.g. wikitext-2 valid.txt)")
    t0 = time.perf_counter()
    source: Any = _GgufSource(src, file_type) if src.is_file() else _HfSource(src, file_type)
    table = [(name, tuple(shape), tensor_type(name, tuple(shape), file_type, source.n_layers, source.tied))
             for name, shape in source.entries]
    for name, shape, t in table:
        if t not in (F32, F16) and shape[-1] % 32:
            raise ValueError(f"{src}: tensor {name} has rows of {shape[-1]} weights, not whole 32-weight blocks; "
                             "llama.cpp's block types cannot hold it")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    found = _Calibrated(out.with_name(f".{out.name}.tmp-{os.getpid()}-calibration"))
    try:
        if calib:
            _calibrate(calib, calib_folder, file_type, source, gptq, found, progress)
        linears = _write(out, source, table, found, calib, progress)
    finally:
        shutil.rmtree(found.folder, ignore_errors=True)
    counts: dict[str, int] = {}
    for _, _, t in table:
        counts[type_name(t)] = counts.get(type_name(t), 0) + 1
    mix = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    how = "GPTQ" if gptq else "importance-weighted scales" if calib else "magnitude-weighted scales"
    return QuantizeReport(out, f"GGUF {file_type.upper()} ({mix}; {how})", linears,
                          time.perf_counter() - t0, source.bytes_in, out.stat().st_size, peak_rss())


def _write(out: Path, source: Any, table: list[tuple[str, tuple[int, ...], int]], found: _Calibrated,
           calib: list[list[int]] | None, progress: bool) -> int:
    """Stream every tensor into ``out``; returns how many were quantized."""
    stream = GgufStream(out, source.arch, _with_imatrix(source.metadata, found.importance, calib), table)
    bar = progress_bar(len(table), progress, "gguf tensors")
    try:
        linears = 0
        for name, shape, t in table:
            if name in found.blocks:
                stream.write(np.load(found.blocks[name]))
            elif t in (F32, F16):
                stream.write(source.read(name).numpy().astype(np.float32 if t == F32 else np.float16))
            else:
                stream.write(quantize_rows(source.read(name).reshape(shape[0], -1), t, found.importance.get(name)))
            linears += t not in (F32, F16)
            if bar is not None:
                bar.update(1)
        stream.finish()
    except BaseException:
        stream.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return linears


def _with_imatrix(metadata: Metadata, importance: dict[str, torch.Tensor], calib: list[list[int]] | None
                  ) -> Metadata:
    """The metadata, with llama.cpp's keys saying an importance matrix chose the scales."""
    if not importance or not calib:
        return metadata
    return [*metadata, ("quantize.imatrix.entries_count", len(importance), GGUFValueType.INT32, None),
            ("quantize.imatrix.chunks_count", len(calib), GGUFValueType.INT32, None)]


def _calibrate(calib: list[list[int]], folder: Path | None, file_type: str, source: Any, gptq: bool,
               found: _Calibrated, progress: bool) -> None:
    """Each decoder linear's E[x^2] (or, with ``gptq``, its GPTQ blocks) by GGUF name into
    ``found``, with earlier layers quantized as they will be."""
    if folder is None:
        raise ValueError("calibration needs the source as a Hugging Face folder")

    def quantize(w: torch.Tensor, stats: Any, parts: Parts) -> tuple[dict[str, Any], torch.Tensor]:
        h = stats.value()
        imp = h if h.dim() == 1 else torch.diagonal(h)
        out: dict[str, Any] = {}
        dq = torch.empty_like(w)
        for prefix, off, rows in parts:
            name = gguf_name(prefix + ".weight")
            t = tensor_type(name, (rows, w.shape[1]), file_type, source.n_layers, source.tied)
            blocks = gptq_ggml(w[off : off + rows], h, t) if gptq else quantize_rows(w[off : off + rows], t, imp)
            dq[off : off + rows] = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, t), dtype=np.float32))
            out[name] = to_file_order(name, blocks, source.heads) if gptq else imp  # calibration runs in HF order
        return out, dq

    bar = progress_bar(source.n_layers, progress, "gptq layers" if gptq else "imatrix layers")
    try:
        calibrate_layers(folder, calib, found, (lambda i, n: bar.update(1)) if bar is not None else None, quantize,
                         diagonal_only=not gptq)
    finally:
        if bar is not None:
            bar.close()
