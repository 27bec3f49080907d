"""Decoder layers read one at a time from a checkpoint's shards, and calibrated results
spilled to disk layer by layer: what keeps GPTQ and AWQ calibration in bounded memory.

``LayerSource`` builds a one-layer shell of the model (vocabulary of 1, so no embedding
matrix is allocated; one per kind of layer: local and global, dense and sparse) and refills its layer from
the shards for each decoder layer, reading only that layer's tensors with positioned reads.
The embedding is read once to embed the calibration windows and dropped. ``ResultStore``
writes each layer's integers (uint8), scales, zeros and g_idx to a safetensors file in the
job's temporary folder and reads one layer back at a time while the checkpoint is written.
Peak memory: one decoder layer in fp32, the calibration activations, and one layer's results.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qpage.formats.safetensors_io import iter_tensors, read_header, write_file
from qpage.layers.linear.factory import Linear
from qpage.models.loader import read_arch_config, weight_files
from qpage.models.moe import qwen_name, split_stacked
from qpage.models.registry import model_class

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(q [in, out] unsigned integers, scales [G, out], zeros [G, out], g_idx [in] or None)."""


class LayerSource:
    def __init__(self, src: Path, max_positions: int) -> None:
        self.arch = read_arch_config(src)
        self.where: dict[str, Path] = {}
        self.stored: dict[str, str] = {}
        """A tensor's name in the model (``models.moe.qwen_name``) -> its name in the checkpoint."""
        for f in weight_files(src, allow_pickle=False):
            for name in read_header(f)[0]:
                self.where[name] = f
                self.stored[qwen_name(name)] = name
        a = self.arch
        kinds = [(a.layer_types[i] if a.layer_types else "all", a.is_sparse(i)) for i in range(a.num_layers)]
        self._kinds = kinds
        self._shells: dict[tuple[str, bool], Any] = {}
        for kind, sparse in dict.fromkeys(kinds):
            shell = dataclasses.replace(a, num_layers=1, vocab_size=1, layer_types=None if kind == "all" else (kind,),
                                        sparse_layers=None if a.sparse_layers is None else (sparse,))
            self._shells[kind, sparse] = model_class(a.architecture)(shell, max_positions, torch.float32)
        self.model: Any = self._shells[kinds[0]]
        """The shell of the first layer (every layer's, when they are all alike)."""
        self._prepared: set[tuple[str, bool]] = set()

    def shell(self, i: int) -> Any:
        """The one-layer model that runs layer ``i`` (its window and rotary tables)."""
        return self._shells[self._kinds[i]]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, set[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], set()).add(n)
        return {n: t for f, want in by_file.items() for n, t in iter_tensors(f, want)}

    def embed(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """The calibration windows' input embeddings (fp32); the embedding is not kept."""
        name = "model.embed_tokens.weight"
        if name not in self.where:
            raise ValueError(f"checkpoint has no {name}")
        e = self.read([name])[name]
        want = (self.arch.vocab_size, self.arch.hidden_size)
        if tuple(e.shape) != want:
            raise ValueError(f"{self.where[name]}: {name} has shape {tuple(e.shape)}, expected {want} from config.json")
        return [F.embedding(torch.tensor(w), e).float() * self.model.embed_scale for w in windows]

    @torch.no_grad()
    def layer(self, i: int) -> Any:
        """The shell's decoder layer, holding layer ``i`` of the checkpoint (fp32)."""
        pre = f"model.layers.{i}."
        tensors = {}  # under the model's names, gpt-oss's stacked experts split
        for name, t in self.read([n for n in self.where if n.startswith(pre)]).items():
            tensors.update(split_stacked(name, t))
        shell, kind = self.shell(i), self._kinds[i]
        targets = {n: t for n, t in shell.weight_targets().items() if n.startswith("model.layers.0.")}
        for name, (dest, off, rows) in targets.items():
            model_name = pre + name[len("model.layers.0."):]
            t = tensors.get(model_name)
            src_name = self.stored.get(model_name, model_name)
            if t is None:
                raise ValueError(f"checkpoint is missing {src_name}; it is incomplete or not a "
                                 f"{self.arch.architecture}")
            want = (rows, *dest.shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(f"{self.where.get(src_name, 'checkpoint')}: tensor {src_name!r} has shape "
                                 f"{tuple(t.shape)}, expected {want} from config.json")
            dest[off : off + rows].copy_(t)
        layer = shell.layers[0]
        if kind not in self._prepared:  # the BLAS copies share storage with the weights: refills reach them
            for m in layer.modules():
                if isinstance(m, Linear):
                    m.prepare(in_place=True)
            self._prepared.add(kind)
        return layer


class ResultStore:
    """Calibrated linears by checkpoint prefix (``model.layers.N.<proj>``), one file per layer
    under ``folder``; reading keeps one layer in memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._layer = -1
        self._cache: dict[str, torch.Tensor] = {}
        self.rtn_fallbacks: list[str] = []
        """Projections rounded rather than calibrated: they saw too few calibration rows."""

    def _path(self, layer: int) -> Path:
        return self.folder / f"layer-{layer:05d}.safetensors"

    def put_layer(self, layer: int, results: dict[str, Result]) -> None:
        flat: dict[str, torch.Tensor] = {}
        for prefix, (q, s, z, g_idx) in results.items():
            flat[prefix + ".q"] = q.to(torch.uint8).contiguous()
            flat[prefix + ".scales"] = s.contiguous()
            flat[prefix + ".zeros"] = z.to(torch.int32).contiguous()
            if g_idx is not None:
                flat[prefix + ".g_idx"] = g_idx.to(torch.int32).clone()
        tmp = self._path(layer).with_suffix(".tmp")
        write_file(tmp, flat)
        tmp.rename(self._path(layer))

    def __getitem__(self, prefix: str) -> Result:
        layer = int(prefix.split(".")[2])
        if layer != self._layer:
            self._cache = dict(iter_tensors(self._path(layer)))
            self._layer = layer
        return (self._cache[prefix + ".q"].to(torch.int32), self._cache[prefix + ".scales"],
                self._cache[prefix + ".zeros"], self._cache.get(prefix + ".g_idx"))
