"""Kernel configurations measured on specific GPUs, shipped as JSON (as vLLM ships its MoE configs).

``python benchmarks/kernels.py --tune`` times candidate configurations on the GPU it runs
on, keeps those whose output matches the ``*_ref`` reference, and writes the fastest per
problem to ``<out dir>/configs/<device key>.json``; copied into ``qpage/kernels/gpu_tables/``
it becomes that GPU's default. The file:

    {"device": "NVIDIA H200", "triton": "3.6.0",
     "matmul": {"int4-g128": {"4096x14336": {"1": {"kind": "gemv", "block_m": 16, ...}, "16": {...}}}},
     "paged_decode": {"fp8-e4m3-per-token/d128/g4": {"block_n": 64, "num_warps": 8, ...}}}

Entries hold the fields of ``configs.MatmulConfig`` and ``configs.DecodeConfig``.

Matmul kinds: ``int{bits}-g{group}`` (GPTQ layout, no act-order), ``int{bits}-chan``
(one group spanning K), ``awq-g{group}``, ``fp8-chan``, ``fp8-block``; shapes ``KxN``; M
keys are the tuned row counts, and a call with m rows takes the smallest tuned M >= m
(the largest when m exceeds them all); an untuned N borrows the nearest tuned N of its K.
Anything absent falls back to the defaults in ``configs``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from qpage.kernels.configs import DecodeConfig, MatmulConfig

logger = logging.getLogger("qpage")

CONFIG_DIR = Path(__file__).with_name("gpu_tables")


def device_key(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' -> 'nvidia_geforce_rtx_4090'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.cache
def read_table(key: str, directory: Path = CONFIG_DIR) -> dict[str, Any]:
    """The shipped table for ``key``; {} when there is none, or when it is unreadable or has
    entries no kernel takes (a warning names the file: the defaults run instead)."""
    path = directory / f"{key}.json"
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text())
        bad = problems(table)
    except (OSError, ValueError, AttributeError) as e:
        bad = [f"unreadable: {e}"]
    if bad:
        logger.warning("tuned kernel table %s ignored (%s); the default kernel settings run. Regenerate it with "
                       "`python benchmarks/kernels.py --tune` on this GPU.", path, "; ".join(bad[:3]))
        return {}
    return table


@functools.cache
def _cuda_key(index: int) -> str:
    return device_key(torch.cuda.get_device_name(index))


_INSTALLED: dict[str, dict[str, Any]] = {}
_ON_INSTALL: list[Callable[[], None]] = []


def on_install(clear: Callable[[], None]) -> None:
    """Have ``install`` call ``clear`` (a selector's cache of choices made from the tables)."""
    _ON_INSTALL.append(clear)


def install(device: torch.device, table: dict[str, Any]) -> None:
    """Use ``table`` for ``device`` in this process (the tuner, before timing its choices)."""
    bad = problems({"device": "installed", **table})
    if bad:
        raise ValueError("kernel table: " + "; ".join(bad))
    _INSTALLED[device.type] = table
    tuned_matmul_config.cache_clear()
    tuned_decode_config.cache_clear()
    for clear in _ON_INSTALL:
        clear()


def table_for(device: torch.device) -> dict[str, Any]:
    """The table of this CUDA device: one installed in this process, else the shipped file
    ({} for CPU or an untuned GPU)."""
    if device.type in _INSTALLED:
        return _INSTALLED[device.type]
    if device.type != "cuda":
        return {}
    return read_table(_cuda_key(device.index if device.index is not None else torch.cuda.current_device()))


def matmul_kind(bits: int, group_size: int, k: int, awq: bool, act_order: bool) -> str | None:
    """The table key of an integer matmul, or None for layouts that are never tuned."""
    if act_order:
        return None
    if awq:
        return f"awq-g{group_size}"
    return f"int{bits}-chan" if group_size >= k else f"int{bits}-g{group_size}"


def pick_m(entries: dict[str, Any], m: int) -> Any:
    """The entry of the smallest tuned M >= m, else of the largest tuned M."""
    if not entries:
        return None
    ms = sorted(int(x) for x in entries)
    chosen = next((x for x in ms if x >= m), ms[-1])
    return entries[str(chosen)]


def tuned_matmul(table: dict[str, Any], kind: str | None, m: int, n: int, k: int) -> dict[str, Any] | None:
    """The tuned matmul config fields for (kind, m, n, k) in ``table``, or None. A shape not
    in the table borrows the entry of the same K whose N is nearest, within a factor of 2
    (fused projections: Llama-3-8B's gate_up is 4096x28672 where the table has 4096x14336)."""
    if kind is None:
        return None
    shapes = table.get("matmul", {}).get(kind, {})
    entries = shapes.get(f"{k}x{n}")
    if entries is None:
        near = [(abs(math.log2(int(s.split("x")[1]) / n)), s) for s in shapes if s.split("x")[0] == str(k)]
        near = [x for x in near if x[0] <= 1.0]
        entries = shapes[min(near)[1]] if near else {}
    return pick_m(entries, m)


@functools.lru_cache(maxsize=4096)
def tuned_matmul_config(device: torch.device, kind: str | None, m: int, n: int, k: int) -> MatmulConfig | None:
    """This device's tuned ``MatmulConfig`` for the problem, or None; cached (looked up per layer
    and step)."""
    entry = tuned_matmul(table_for(device), kind, m, n, k)
    return MatmulConfig(**entry) if entry else None


@functools.lru_cache(maxsize=256)
def tuned_decode_config(device: torch.device, fp8_format: str | None, per_token: bool, head_dim: int, group: int,
                        default: DecodeConfig) -> DecodeConfig:
    """``default`` with this device's tuned paged-decode fields for the cache mode laid over it."""
    entry = table_for(device).get("paged_decode", {}).get(decode_key(fp8_format, per_token, head_dim, group), {})
    return DecodeConfig(**{**default.__dict__, **entry})


def decode_key(fp8_format: str | None, per_token: bool, head_dim: int, group: int) -> str:
    mode = "fp16" if fp8_format is None else f"fp8-{fp8_format}-{'per-token' if per_token else 'per-tensor'}"
    return f"{mode}/d{head_dim}/g{group}"


def problems(table: dict[str, Any]) -> list[str]:
    """What is wrong with a table (empty when every entry is usable)."""
    errors = []
    if "device" not in table:
        errors.append("no 'device' field")
    for kind, shapes in table.get("matmul", {}).items():
        for shape, per_m in shapes.items():
            if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", shape):
                errors.append(f"matmul {kind}: shape {shape!r} is not KxN")
            for m, cfg in per_m.items():
                where = f"matmul {kind} {shape} M={m}"
                if not m.isdigit() or int(m) < 1:
                    errors.append(f"{where}: M must be a positive integer")
                bad = _entry_problems(where, MatmulConfig, cfg)
                if not bad and (cfg["block_k"] % 8 or cfg["block_n"] % 8 or cfg.get("split_k", 1) < 1):
                    bad.append(f"{where}: block_k and block_n must be multiples of 8, split_k >= 1")
                errors += bad
    for key, cfg in table.get("paged_decode", {}).items():
        errors += _entry_problems(f"paged_decode {key}", DecodeConfig, cfg)
    return errors


def _entry_problems(where: str, config: type, entry: dict[str, Any]) -> list[str]:
    unknown = set(entry) - {f.name for f in fields(config)}
    if unknown:
        return [f"{where}: unknown fields {sorted(unknown)}"]
    try:
        config(**entry)
    except (TypeError, ValueError) as e:
        return [f"{where}: {e}"]
    return []
