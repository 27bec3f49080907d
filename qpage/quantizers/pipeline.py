"""``qpage quantize``: a checkpoint in, a quantized checkpoint out, one tensor at a time.

Memory stays bounded: source tensors are read lazily from their safetensors shards (one at
a time), each decoder linear is quantized as it is read, and output shards are flushed to
disk whenever the buffer passes ``shard_bytes``. Everything is written into a temporary
folder beside the output and renamed into place at the end, so an interrupted run leaves
no half-written checkpoint (the temporary folder is removed; a stale one from a killed run
is removed by the next).

RTN, imatrix and GPTQ to INT4/INT8 write the GPTQ format (``formats.gptq``); FP8 (per
channel or 128x128 blocks) writes compressed-tensors (``formats.fp8``); NF4 writes
bitsandbytes' 4-bit format as transformers saves it (``formats.bnb``). Calibration (imatrix,
GPTQ, AWQ) runs first, layer by layer (``calibrate``), and its results go through the same
writer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qpage.formats import awq as awq_format
from qpage.formats import bnb as bnb_format
from qpage.formats import compressed_tensors as ct_format
from qpage.formats import fp8 as fp8_format
from qpage.formats.gptq import pack_linear, quantization_config
from qpage.formats.safetensors_io import iter_tensors, read_header, write_file
from qpage.formats.scheme import CALIBRATED, QuantScheme
from qpage.models.loader import weight_files
from qpage.models.moe import GPT_OSS_EXPERTS, gpt_oss_experts, mixtral_name
from qpage.quantizers.fp8 import quantize_fp8
from qpage.quantizers.nf4 import quantize_nf4
from qpage.quantizers.rtn import quantize_rtn

LINEAR = re.compile(r"^(model\.layers\.\d+\.(?:self_attn\.(?:[qkvo]|qkv)_proj"
                    r"|mlp\.(?:experts\.\d+\.|shared_expert\.)?(?:gate|up|down|gate_up)_proj"
                    r"|block_sparse_moe\.experts\.\d+\.w[123]))\.weight$")
"""A decoder projection's weight: separate (Llama) or fused as stored (Phi-3's qkv_proj, gate_up_proj),
or an expert's (Qwen's MoE names, Mixtral's w1/w3/w2). Routers stay in full precision."""


@dataclass
class QuantizeReport:
    out: Path
    scheme: str
    linears: int
    seconds: float
    bytes_in: int
    bytes_out: int
    peak_rss_bytes: int
    rtn_fallbacks: int = 0
    """Linears rounded rather than calibrated: experts that too few calibration rows were routed to."""


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; the decoder linears, quantized and dropped before the
    next tensor is read, share one reused read buffer. gpt-oss's stacked experts come out one
    tensor per expert and projection (``models.moe.gpt_oss_experts``), as every other MoE's."""
    for f in files:
        for name, t in iter_tensors(f, transient=lambda name: LINEAR.match(name) is not None):
            m = GPT_OSS_EXPERTS.match(name)
            if m is None:
                yield name, t
            else:
                yield from gpt_oss_experts(m.group(1), m.group(2), t, m.group(3))


def _linear_shapes(files: list[Path]) -> dict[str, list[int]]:
    """[out, in] of every decoder linear; also validates every file's header before any work starts."""
    out = {}
    for f in files:
        for k, info in read_header(f)[0].items():
            m = LINEAR.match(k)
            if m:
                out[m.group(1)] = info["shape"]
            g = GPT_OSS_EXPERTS.match(k)
            if g and not g.group(3):  # [experts, in, out]: each expert's projections
                experts, k_in, n_out = info["shape"]
                projs = ("gate_proj", "up_proj") if g.group(2) == "gate_up_proj" else ("down_proj",)
                for e in range(experts):
                    for proj in projs:
                        out[f"{g.group(1)}.mlp.experts.{e}.{proj}"] = [n_out // len(projs), k_in]
    return out


FORMATS = ("auto", "gptq", "awq", "compressed-tensors", "bitsandbytes")


def choose_format(scheme: QuantScheme, fmt: str, shapes: dict[str, list[int]]) -> str:
    """The output format: ``auto`` is compressed-tensors for FP8, bitsandbytes for NF4, AWQ for
    AWQ when every width divides by the group (else GPTQ, which allows a partial last group),
    GPTQ otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if scheme.is_nf4 or fmt == "bitsandbytes":
        if not (scheme.is_nf4 and fmt in ("auto", "bitsandbytes")):
            raise ValueError("the bitsandbytes format holds NF4 weights (--scheme nf4) and NF4 is written only as "
                             "bitsandbytes; drop --format or change --scheme")
        return "bitsandbytes"
    if scheme.is_fp8:
        if fmt not in ("auto", "compressed-tensors"):
            raise ValueError(f"FP8 weights are written as compressed-tensors, not {fmt}; drop --format")
        return "compressed-tensors"
    if fmt == "compressed-tensors":
        return "compressed-tensors"
    if fmt == "awq" or (fmt == "auto" and scheme.method == "awq"):
        from qpage.formats.awq import check_writable

        if scheme.bits != 4 or scheme.act_order:
            if fmt == "awq":
                raise ValueError("the AWQ format holds 4-bit weights without act-order; use --format gptq")
            return "gptq"
        try:
            for name, (_, in_f) in shapes.items():
                check_writable(name, in_f, scheme.group_size)
        except ValueError:
            if fmt == "awq":
                raise
            return "gptq"
        return "awq"
    return "gptq"


class _ShardWriter:
    """Output shards of about ``shard_bytes``, each written by a background thread while the
    next one fills (writing, not quantizing, bounds RTN's speed on a slow disk), so at most
    two shards are in memory. ``close`` waits for the writes and reports their errors."""

    def __init__(self, folder: Path, shard_bytes: int) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[str, list[str]]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qpage-writer")
        self._pending: Future | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        self.buffer[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        self._wait()
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        self._pending = self._pool.submit(write_file, self.folder / name, self.buffer)
        self.shards.append((name, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)

    def finish(self) -> None:
        self.flush()
        self.close()
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
                        progress: bool = True, calib: list[list[int]] | None = None,
                        fmt: str = "auto") -> QuantizeReport:
    """Quantize every decoder linear of ``src`` (a HF folder) into a new folder ``out``.

    RTN needs nothing else; imatrix, GPTQ and AWQ need ``calib``, token windows of calibration text."""
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
    shapes = _linear_shapes(files)
    total = len(shapes)
    fmt = choose_format(scheme, fmt, shapes)
    if fmt == "compressed-tensors" and scheme.act_order and not scheme.static_groups:
        # compressed-tensors keeps no permuted g_idx (its ``actorder: group`` was removed).
        scheme = dataclasses.replace(scheme, static_groups=True)
    if total == 0:
        raise ValueError(f"{src}: found no decoder linear weights (model.layers.N.*_proj.weight)")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    writer = _ShardWriter(tmp, shard_bytes)
    try:
        calibrated, overrides = _calibrate(src, scheme, calib, progress, tmp / ".calibration")
        bar = progress_bar(total, progress)
        done = 0
        unused = set(overrides)
        for name, t in _tensors(files):
            m = LINEAR.match(name)
            if m is None:
                writer.add(name, overrides[name].to(t.dtype) if name in overrides else t)
                unused.discard(name)
                continue
            for key, packed in _quantize_linear(m.group(1), t, scheme, calibrated, fmt).items():
                writer.add(key, packed)
            done += 1
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        if unused:  # a rewritten float tensor the checkpoint names otherwise: the model would change
            raise ValueError(f"{src}: {scheme.method} rewrote {sorted(unused)[:3]}, which the checkpoint does not "
                             "hold under those names (fused projections?); quantize it with gptq or rtn")
        writer.finish()
        shutil.rmtree(tmp / ".calibration", ignore_errors=True)
        config["quantization_config"] = _quantization_config(scheme, fmt)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in src.iterdir():  # tokenizer, generation config, chat template
            if f.is_file() and f.name != "config.json" and f.suffix not in (".safetensors", ".bin", ".pt") \
                    and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        tmp.rename(out)
    except BaseException:
        try:
            writer.close()  # no write may still be running when the folder goes
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeReport(out, f"{scheme.describe()} ({fmt} format)", done, time.perf_counter() - t0, _size(files),
                          _size(list(out.glob("*.safetensors"))), peak_rss(),
                          len(getattr(calibrated, "rtn_fallbacks", ())))


def _quantization_config(scheme: QuantScheme, fmt: str) -> dict[str, Any]:
    """The ``quantization_config`` written to config.json for ``scheme`` in format ``fmt``."""
    if fmt == "compressed-tensors":
        return fp8_format.quantization_config(scheme.block) if scheme.is_fp8 else ct_format.quantization_config(scheme)
    if fmt == "awq":
        return awq_format.quantization_config(scheme)
    if fmt == "bitsandbytes":
        return bnb_format.quantization_config()
    return quantization_config(scheme)


def _calibrate(src: Path, scheme: QuantScheme, calib: list[list[int]] | None, progress: bool, spill: Path
               ) -> tuple[Any, dict[str, torch.Tensor]]:
    """Calibrated results by projection prefix (a ``ResultStore`` spilled under ``spill``; None
    for RTN/FP8/NF4), and the float tensors AWQ rewrote (norms, routers, biases)."""
    if scheme.method not in CALIBRATED:
        return None, {}
    if not calib:
        raise ValueError(f"{scheme.method.upper()} needs calibration text: pass --calib FILE "
                         "(e.g. wikitext-2 valid.txt)")
    from qpage.quantizers import calibrate
    from qpage.quantizers.awq_layers import awq_calibrate
    from qpage.quantizers.layer_source import ResultStore
    from qpage.quantizers.signround import signround_calibrate

    bar = progress_bar(_num_layers(src), progress, f"{scheme.method} layers")
    step = (lambda i, n: bar.update(1)) if bar is not None else None
    try:
        if scheme.method == "gptq":
            return calibrate.gptq_calibrate(src, scheme, calib, ResultStore(spill), on_layer=step), {}
        if scheme.method == "imatrix":
            return calibrate.imatrix_calibrate(src, scheme, calib, ResultStore(spill), on_layer=step), {}
        if scheme.method == "signround":
            return signround_calibrate(src, scheme, calib, ResultStore(spill), on_layer=step), {}
        return awq_calibrate(src, scheme, calib, ResultStore(spill), on_layer=step)
    finally:
        if bar is not None:
            bar.close()


def _quantize_linear(prefix: str, w: torch.Tensor, scheme: QuantScheme,
                     calibrated: Any, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear in format ``fmt``."""
    if scheme.is_fp8:
        return fp8_format.pack_linear(prefix, *quantize_fp8(w, scheme.block))
    if scheme.is_nf4:
        return bnb_format.pack_linear(prefix, *quantize_nf4(w))
    if calibrated is not None:
        q, scales, zeros, g_idx = calibrated[mixtral_name(prefix)]
    else:
        q, scales, zeros = quantize_rtn(w, scheme.bits, scheme.group_size, scheme.sym)
        g_idx = None
    if fmt == "awq":
        return awq_format.pack_linear(prefix, q, scales, zeros, scheme.group_size)
    if fmt == "compressed-tensors":
        return ct_format.pack_linear(prefix, q, scales, zeros, scheme.bits, scheme.sym, scheme.group_size, g_idx)
    return pack_linear(prefix, q, scales, zeros, scheme.bits, scheme.group_size, g_idx)


def _num_layers(src: Path) -> int:
    return int(json.loads((src / "config.json").read_text())["num_hidden_layers"])


def progress_bar(total: int, enabled: bool, desc: str = "quantize") -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    unit = next((u for u in ("layer", "tensor") if u in desc), "linear")
    return tqdm(total=total, desc=desc, unit=unit)


def _size(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
