"""Turns a SchedulerOutput into tensors, runs the model, and returns the logits to sample.

The batch is flattened: single-token requests (decodes) first, then prefill chunks, each
a contiguous row range. Per step this builds ``input_ids``, ``positions``, ``slot_mapping``
(block_id * BLOCK_SIZE + offset for each new token) and the backend-neutral
``AttentionBatch``, from which the attention backend builds its own metadata once; every
layer reuses them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from qpage.config import BLOCK_SIZE
from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request
from qpage.engine.scheduler import ScheduledRequest, SchedulerOutput
from qpage.kernels.kv_int import hadamard
from qpage.layers.attention_metadata import AttentionBatch, SeqSpan
from qpage.layers.backends import select_attention_backend
from qpage.layers.kv_format import KVCacheSpec, make_layer_kv
from qpage.models.arch import ArchConfig

logger = logging.getLogger("qpage")

@dataclass
class StepOutput:
    sample_requests: list[Request] = field(default_factory=list)
    """Requests that sample a token this step, in the row order of ``logits``."""
    logits: torch.Tensor | None = None
    """fp32 [len(sample_requests), vocab]."""
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """request id -> (first prompt position, fp32 logits [rows, vocab]) for prompt_logprobs."""


@dataclass
class _Batch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    decodes: list[SeqSpan] = field(default_factory=list)
    prefills: list[SeqSpan] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, arch: ArchConfig, kv: KVCacheManager,
        dtype: torch.dtype, device: torch.device,
        kv_spec: KVCacheSpec | None = None, attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.arch = arch
        self.kv = kv
        self.device = device
        spec = kv_spec or KVCacheSpec(dtype)
        self.backend = select_attention_backend(device, spec, arch.head_dim, attention_backend)
        scales: dict[int, tuple[float, float]] = getattr(model, "kv_scales", {})
        if spec.fp8_format is not None and not spec.per_token and len(scales) < arch.num_layers:
            logger.warning("kv_cache_scales=per_tensor: the checkpoint has no k_scale/v_scale for %d of %d "
                           "layers; using 1.0 there (vLLM's default)", arch.num_layers - len(scales),
                           arch.num_layers)
        block = hadamard(arch.head_dim)[1]
        if spec.kv_bits is not None and spec.rotate and block < arch.head_dim:
            logger.info("head_dim %d is not a power of two: the %s cache rotates K/V by a block-diagonal "
                        "Hadamard matrix of %d-wide blocks", arch.head_dim, spec.format, block)
        self.caches = [
            make_layer_kv(spec, kv.num_blocks, arch.num_kv_heads, arch.head_dim, device, scales.get(i))
            for i in range(arch.num_layers)
        ]

    @torch.inference_mode()
    def calibrate_kv_shifts(self, token_ids: list[int]) -> None:
        """Set each layer's K/V shifts to their per-channel means over ``token_ids`` (a
        forward pass into a scratch cache in the model dtype; the real cache is untouched)."""
        n = len(token_ids)
        nb = -(-n // BLOCK_SIZE)
        spec = KVCacheSpec(self.caches[0].dtype)
        scratch = [make_layer_kv(spec, nb, self.arch.num_kv_heads, self.arch.head_dim, self.device)
                   for _ in range(self.arch.num_layers)]
        means: list[tuple[torch.Tensor, torch.Tensor]] = []
        inner = select_attention_backend(self.device, spec, self.arch.head_dim, "torch")

        class _Recorder:
            name = "calibration"

            def build_metadata(self, batch: AttentionBatch, device: torch.device) -> object:
                return inner.build_metadata(batch, device)  # type: ignore[attr-defined]

            def write_cache(self, k: torch.Tensor, v: torch.Tensor, cache: object, slots: torch.Tensor) -> None:
                means.append((k.float().mean(0), v.float().mean(0)))
                inner.write_cache(k, v, cache, slots)  # type: ignore[attr-defined]

            def attend(self, *args: object) -> torch.Tensor:
                return inner.attend(*args)  # type: ignore[attr-defined]

        pos = torch.arange(n, device=self.device)
        recorder = _Recorder()
        meta = recorder.build_metadata(AttentionBatch(pos, prefills=[SeqSpan(0, n, n, list(range(nb)))]), self.device)
        self.model(torch.tensor(token_ids, device=self.device), pos, scratch, meta, recorder)
        for cache, (k_mean, v_mean) in zip(self.caches, means, strict=True):
            cache.set_shifts(k_mean, v_mean)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepOutput:
        decodes = sorted((s for s in out.scheduled if s.num_tokens == 1),
                         key=lambda s: -s.request.num_computed_tokens)
        prefills = [s for s in out.scheduled if s.num_tokens > 1]
        batch = _Batch()
        self._prepare_decodes(decodes, batch)
        self._prepare_prefills(prefills, batch)
        dev = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
        positions = torch.cat(batch.positions).to(dev)
        step = AttentionBatch(torch.cat(batch.slots).to(dev), batch.decodes, batch.prefills)
        meta = self.backend.build_metadata(step, dev)
        hidden = self.model(input_ids, positions, self.caches, meta, self.backend)
        return self._select_logits(decodes + prefills, hidden)

    def _prepare_decodes(self, decodes: list[ScheduledRequest], batch: _Batch) -> None:
        """Decodes are ordered longest context first (the caller keeps this order for the logits)."""
        if not decodes:
            return
        n = len(decodes)
        pos = torch.tensor([s.request.num_computed_tokens for s in decodes], dtype=torch.long)
        slots = torch.empty(n, dtype=torch.long)
        for i, s in enumerate(decodes):
            p = s.request.num_computed_tokens
            table = self.kv.block_ids(s.request.request_id)
            batch.input_ids.append(s.request.all_token_ids[p])
            slots[i] = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            batch.decodes.append(SeqSpan(i, i + 1, p + 1, list(table)))
        batch.positions.append(pos)
        batch.slots.append(slots)

    def _prepare_prefills(self, prefills: list[ScheduledRequest], batch: _Batch) -> None:
        row = len(batch.input_ids)
        for s in prefills:
            req, n = s.request, s.num_tokens
            start = req.num_computed_tokens
            ctx = start + n
            batch.input_ids.extend(req.all_token_ids[start:ctx])
            pos = torch.arange(start, ctx, dtype=torch.long)
            table = self.kv.block_ids(req.request_id)
            blocks = torch.tensor(table, dtype=torch.long)
            batch.positions.append(pos)
            batch.slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            batch.prefills.append(SeqSpan(row, row + n, ctx, list(table)))
            row += n

    def _select_logits(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> StepOutput:
        step = StepOutput()
        rows: list[int] = []
        row = 0
        for s in ordered:
            req = s.request
            if req.needs_prompt_logprobs and req.num_computed_tokens < req.num_prompt_tokens - 1:
                # Positions p in this chunk with p + 1 a prompt token predict that token.
                first = req.num_computed_tokens
                last = min(first + s.num_tokens, req.num_prompt_tokens - 1)
                h = hidden[row : row + last - first]
                step.prompt_logits[req.request_id] = (first, self.model.compute_logits(h).float().cpu())
            if s.samples:
                rows.append(row + s.num_tokens - 1)
                step.sample_requests.append(req)
            row += s.num_tokens
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
            step.logits = self.model.compute_logits(hidden[idx]).float().cpu()
        return step
