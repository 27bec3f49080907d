"""``qpage quantize``: a checkpoint in, a quantized checkpoint out, one tensor at a time.

Memory stays bounded: source tensors are read lazily from their safetensors shards (one at
a time), each decoder linear is quantized as it is read, and output shards are flushed to
disk whenever the buffer passes ``shard_bytes``. Everything is written into a temporary
folder beside the output and renamed into place at the end, so an interrupted run leaves
no half-written checkpoint (the temporary folder is removed; a stale one from a killed run
is removed by the next).

Today: RTN to INT4/INT8 in the GPTQ format (``formats.gptq``). GPTQ and AWQ need
calibration activations and will run layer by layer through the same writer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qpage.formats.gptq import pack_linear, quantization_config
from qpage.formats.safetensors_io import iter_tensors, read_header, write_file
from qpage.models.loader import weight_files
from qpage.quantizers.rtn import quantize_rtn
from qpage.quantizers.scheme import QuantScheme

LINEAR = re.compile(r"^(model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight$")


@dataclass
class QuantizeReport:
    out: Path
    scheme: str
    linears: int
    seconds: float
    bytes_in: int
    bytes_out: int
    peak_rss_bytes: int


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        yield from iter_tensors(f)


def _count_linears(files: list[Path]) -> int:
    """Also validates every file's header before any work starts."""
    return sum(1 for f in files for k in read_header(f)[0] if LINEAR.match(k))


class _ShardWriter:
    def __init__(self, folder: Path, shard_bytes: int) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[str, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        self.buffer[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        write_file(self.folder / name, self.buffer)
        self.shards.append((name, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        total = len(self.shards)
        weight_map = {}
        for i, (name, keys) in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            (self.folder / name).rename(self.folder / final)
            weight_map.update(dict.fromkeys(keys, final))
        size = sum((self.folder / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": size}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def quantize_checkpoint(src: Path, out: Path, scheme: QuantScheme, shard_bytes: int = 512 << 20,
                        progress: bool = True, calib: list[list[int]] | None = None) -> QuantizeReport:
    """Quantize every decoder linear of ``src`` (a HF folder) into a new folder ``out``.

    RTN needs nothing else; GPTQ needs ``calib``, token windows of calibration text."""
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output folder or delete it first")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{src} has no config.json; give a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         "quantize the original checkpoint")
    files = weight_files(src, allow_pickle=False)
    total = _count_linears(files)
    if total == 0:
        raise ValueError(f"{src}: found no decoder linear weights (model.layers.N.*_proj.weight)")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    calibrated = None
    if scheme.method == "gptq":
        if not calib:
            raise ValueError("GPTQ needs calibration text: pass --calib FILE (e.g. wikitext-2 valid.txt)")
        from qpage.quantizers.calibrate import gptq_calibrate

        cbar = _progress(_num_layers(src), progress, "gptq layers")
        calibrated = gptq_calibrate(src, scheme, calib, on_layer=(lambda i, n: cbar.update(1)) if cbar else None)
        if cbar is not None:
            cbar.close()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, shard_bytes)
        bar = _progress(total, progress)
        done = 0
        for name, t in _tensors(files):
            m = LINEAR.match(name)
            if m is None:
                writer.add(name, t)
                continue
            if calibrated is not None:
                q, scales, zeros, g_idx = calibrated[m.group(1)]
            else:
                q, scales, zeros = quantize_rtn(t, scheme.bits, scheme.group_size, scheme.sym)
                g_idx = None
            for key, packed in pack_linear(m.group(1), q, scales, zeros, scheme.bits, scheme.group_size,
                                           g_idx).items():
                writer.add(key, packed)
            done += 1
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        writer.finish()
        config["quantization_config"] = quantization_config(scheme)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in src.iterdir():  # tokenizer, generation config, chat template
            if f.is_file() and f.name != "config.json" and f.suffix not in (".safetensors", ".bin", ".pt") \
                    and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeReport(out, scheme.describe(), done, time.perf_counter() - t0, _size(files),
                          _size(list(out.glob("*.safetensors"))), _peak_rss())


def _num_layers(src: Path) -> int:
    return int(json.loads((src / "config.json").read_text())["num_hidden_layers"])


def _progress(total: int, enabled: bool, desc: str = "quantize") -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer" if "layer" in desc else "linear")


def _size(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
