"""``qpage inspect``: what a checkpoint is and what it becomes here.

From the files: format, scheme, bits per weight, size on disk, architecture. From loading
it on the chosen device (``load=True``, the default of the command): the weights' size in
memory on their kernel paths and how many linear layers run on each path, which is what
the engine would do with it. When ``qpage quantize --eval-text`` scored the checkpoint, its
perplexity report (``eval_file``: in the folder, or beside a GGUF file) is shown too.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qpage.formats.awq import AwqConfig
from qpage.formats.bnb import BnbConfig
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.detect import linear_config
from qpage.formats.fp8 import Fp8Config
from qpage.formats.gguf import default_gguf_path
from qpage.formats.gguf_reader import GgufFile
from qpage.formats.mxfp4 import Mxfp4Config
from qpage.layers.moe import SparseMoe
from qpage.models.loader import load_model, read_arch_config, resolve_dtype, resolve_model_dir, weight_files

EVAL_FILE = "qpage_eval.json"
"""The perplexity report ``qpage quantize --eval-text`` saves beside a checkpoint."""
MAX_POSITIONS = 2048
"""Rotary table length for the load (only the weights are reported)."""


def gguf_info(path: Path) -> dict[str, Any]:
    """Tensor types, sizes and bits per weight of a GGUF file, read from its header."""
    f = GgufFile(path)
    types: Counter[str] = Counter()
    elements = nbytes = 0
    tensors = []
    for t in f.tensors.values():
        types[t.type_name] += 1
        n = int(np.prod(t.shape))
        elements += n
        nbytes += t.nbytes
        tensors.append({"name": t.name, "type": t.type_name, "shape": list(t.shape),
                        "bits_per_weight": round(t.bits_per_weight, 3)})
    main = max(types, key=lambda k: types[k]) if types else "?"
    arch = f.get("general.architecture") or "?"
    return {"architecture": f"{arch} (gguf)", "layers": f.get(f"{arch}.block_count"),
            "hidden_size": f.get(f"{arch}.embedding_length"),
            "format": "gguf", "scheme": main, "tensor_types": dict(types.most_common()),
            "bits_per_weight": 8 * nbytes / max(elements, 1), "tensor_bytes": nbytes,
            "size_bytes": path.stat().st_size, "tensors": tensors,
            "loaded_as": "natively: block formats stay packed where a kernel runs them (see the paths below)"}


def quant_info(qc: dict[str, Any], in_features: int) -> dict[str, Any]:
    """Format, scheme and bits per weight from a checkpoint's ``quantization_config``."""
    cfg = linear_config(qc, "config.json")
    if isinstance(cfg, Fp8Config):
        per_scale = cfg.block * cfg.block if cfg.block else in_features
        scales = f"{cfg.block}x{cfg.block} block scales" if cfg.block else "per-channel scales"
        return {"format": cfg.source, "scheme": f"fp8 e4m3, {scales}", "bits_per_weight": 8 + 32 / per_scale}
    if isinstance(cfg, BnbConfig):  # the block size is per tensor (its quant_state), not in the config
        nested = ", double-quantized absmax" if cfg.nested else ""
        return {"format": "bitsandbytes (4-bit)", "scheme": f"{cfg.quant_type} per-block absmax{nested}"}
    if isinstance(cfg, Mxfp4Config):
        return {"format": "mxfp4 (gpt-oss)", "scheme": "experts in MXFP4 (E2M1, E8M0 scale per 32), the rest float",
                "bits_per_weight": 4.25}
    g = cfg.group_size or in_features
    if isinstance(cfg, AwqConfig):
        fmt = "awq (gemm)"
    elif isinstance(cfg, CtIntConfig):
        fmt = "compressed-tensors (pack-quantized)"
    else:
        fmt = f"gptq ({qc.get('checkpoint_format', 'gptq')})"
    sym = cfg.sym and not isinstance(cfg, AwqConfig)
    group = f"g{cfg.group_size}" if cfg.group_size else "per channel"
    info: dict[str, Any] = {
        "format": fmt, "scheme": f"int{cfg.bits} {group} {'sym' if sym else 'asym'}" + (" act-order" if
                                                                                        cfg.desc_act else ""),
        "bits": cfg.bits, "group_size": cfg.group_size, "sym": sym, "desc_act": cfg.desc_act,
        "bits_per_weight": cfg.bits + (16 + (0 if sym else cfg.bits)) / g,
    }
    actorder = next(iter(qc.get("config_groups", {}).values()), {}).get("weights", {}).get("actorder")
    if isinstance(cfg, CtIntConfig) and actorder:
        info["actorder"] = actorder  # "weight": act-order with static groups (no g_idx)
    elif qc.get("static_groups"):
        info["static_groups"] = True
    return info


def loaded_info(model_dir: Path, arch: Any, device: str, dtype: str) -> dict[str, Any]:
    """Load the weights as the engine would; bytes in memory and layers per kernel path."""
    dev = torch.device(device)
    dt = resolve_dtype(dtype, arch, dev)
    model = load_model(model_dir, arch, dt, dev, min(arch.max_position_embeddings, MAX_POSITIONS))
    paths: Counter[str] = Counter()
    path_bytes: Counter[str] = Counter()
    other = 0
    for mod in model.modules():
        if hasattr(mod, "kernel_path"):
            paths[mod.kernel_path] += 1
            path_bytes[mod.kernel_path] += mod.weight_bytes
        elif not any(hasattr(m, "kernel_path") for m in mod.modules() if m is not mod):
            other += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    moe = [m for m in model.modules() if isinstance(m, SparseMoe)]
    return {"device": dev.type, "dtype": str(dt).removeprefix("torch."),
            "memory_bytes": sum(path_bytes.values()) + other,
            "linear_paths": {p: {"layers": n, "bytes": path_bytes[p]} for p, n in paths.most_common()},
            **({"experts_paths": dict(Counter(m.experts_path for m in moe)),
                "experts_unfit": next((m.unfit for m in moe if m.kernel is None), "")} if moe else {})}


def eval_file(model: Path) -> Path:
    """Where ``qpage quantize --eval-text`` saves its report: in a model folder, or beside a
    GGUF file (named after it)."""
    return model.with_name(f"{model.name}.{EVAL_FILE}") if model.is_file() else model / EVAL_FILE


def describe(model: str | None, load: bool = True, device: str = "cpu", dtype: str = "auto") -> dict[str, Any]:
    """Everything ``qpage inspect`` shows, as a dict (its ``--json`` output)."""
    default = model in (None, "default")
    path = default_gguf_path() if default else Path(model).expanduser()  # type: ignore[arg-type]
    gguf = path if path.suffix == ".gguf" and path.is_file() else None
    if gguf is not None and not load:  # the header says it all
        info = {"model": str(gguf), **gguf_info(gguf)}
        if eval_file(gguf).is_file():
            info["quality"] = json.loads(eval_file(gguf).read_text())["texts"]
        return info
    model_dir = resolve_model_dir(None if default else str(path))
    arch = read_arch_config(model_dir)
    info: dict[str, Any] = {"model": str(gguf or model_dir), "architecture": arch.architecture,
                            "layers": arch.num_layers, "hidden_size": arch.hidden_size}
    if gguf is not None:
        info.update({k: v for k, v in gguf_info(gguf).items() if k not in info})
    else:
        files = weight_files(model_dir, allow_pickle=False)
        info.update(files=len(files), size_bytes=sum(f.stat().st_size for f in files))
        qc = arch.quantization
        info.update(quant_info(qc, arch.hidden_size) if qc else {"format": "safetensors (dense)",
                                                                  "scheme": str(arch.torch_dtype)})
    if arch.num_experts:
        info["experts"] = {"sparse_layers": sum(arch.is_sparse(i) for i in range(arch.num_layers)),
                           "experts": arch.num_experts, "per_token": arch.experts_per_token,
                           "shared_expert": bool(arch.shared_expert_intermediate_size)}
    if eval_file(model_dir).is_file():
        info["quality"] = json.loads(eval_file(model_dir).read_text())["texts"]
    if load:
        info["loaded"] = loaded_info(model_dir, arch, device, dtype)
    return info


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def table(info: dict[str, Any]) -> str:
    """The readable form: one line per property."""
    rows = [("model", info["model"]), ("format", info["format"]), ("scheme", info["scheme"])]
    if "tensor_types" in info:
        rows.append(("tensor types", ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items())))
    if "bits_per_weight" in info:
        rows.append(("bits per weight", f"{info['bits_per_weight']:.2f}"))
    rows += [("architecture", f"{info['architecture']}, {info['layers']} layers, hidden {info['hidden_size']}"),
             ("size on disk", mib(info["size_bytes"]))]
    if "experts" in info:
        e = info["experts"]
        rows.append(("experts", f"{e['sparse_layers']} sparse layers of {e['experts']}, {e['per_token']} per token"
                     + (", a shared expert" if e["shared_expert"] else "")))
    if "loaded_as" in info:
        rows.append(("loaded as", info["loaded_as"]))
    loaded = info.get("loaded")
    if loaded:
        rows.append((f"in memory ({loaded['device']}, {loaded['dtype']})", mib(loaded["memory_bytes"])))
        for path, v in loaded["linear_paths"].items():
            rows.append(("linear layers", f"{v['layers']} on {path} ({mib(v['bytes'])})"))
        for path, n in loaded.get("experts_paths", {}).items():
            why = f" ({loaded['experts_unfit']})" if path == "torch" and loaded["experts_unfit"] else ""
            rows.append(("expert layers", f"{n} on {path}{why}"))
    for q in info.get("quality", []):
        ppl, src = q["perplexity"], q["source_perplexity"]
        rows.append((f"perplexity, {q['text']}", f"{ppl:.4f} against the source's {src:.4f} "
                     f"({100 * (ppl / src - 1):+.2f}%), mean KL {q['mean_kl']:.4f} "
                     f"({q['windows']} x {q['seq_len']} tokens)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
