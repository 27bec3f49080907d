"""Turns a SchedulerOutput into tensors, runs the model, samples, and returns token ids and
logprobs (``batch.StepResult``; full logits stay here, or go to a caller that scores text).

The batch is flattened: decode rows first (one per request, or one per token for a request
verifying draft tokens), then prefill chunks, each a contiguous row range. Per step this
builds ``input_ids``, ``positions``, and for each group of the KV layout (``kv_layout``: one
group unless the model has sliding-window layers beside global ones) a ``slot_mapping``
(block_id * BLOCK_SIZE + offset for each new token) and the backend-neutral
``AttentionBatch``, from which the attention backend builds its own metadata once; every
layer of the group reuses them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu.matmul import blas
from qpage.kernels.kv_int import hadamard
from qpage.layers.attention.kv_format import KVCacheSpec, layer_view, make_layer_kv
from qpage.layers.attention.kv_layout import KVLayout
from qpage.layers.attention.metadata import AttentionBatch, SeqSpan
from qpage.layers.attention.selector import select_attention_backend
from qpage.models.arch import ArchConfig
from qpage.models.fused_decode import unfit_reason_for
from qpage.runner.batch import Logprob, ScheduledRequest, SchedulerOutput, StepLogits, StepResult
from qpage.runner.sampler import Sampler, top_logprobs

logger = logging.getLogger("qpage")


@dataclass
class GroupRows:
    """One KV group's part of a step: where each new token's K/V goes, and each row's span
    with the group's block table."""

    slots: list[torch.Tensor] = field(default_factory=list)
    decodes: list[SeqSpan] = field(default_factory=list)
    prefills: list[SeqSpan] = field(default_factory=list)


@dataclass
class StepInputs:
    """One step's model inputs, all a rank needs to run it (sent to tensor-parallel workers)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    groups: list[GroupRows] = field(default_factory=list)
    """Per group of the KV layout."""
    logit_rows: list[torch.Tensor] = field(default_factory=list)
    """Rows of the hidden states whose logits are computed, one tensor per ``compute_logits`` call."""

    def group(self, g: int) -> GroupRows:
        while len(self.groups) <= g:
            self.groups.append(GroupRows())
        return self.groups[g]


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, arch: ArchConfig, num_blocks: int,
        dtype: torch.dtype, device: torch.device,
        kv_spec: KVCacheSpec | None = None, attention_backend: str = "auto",
        sampler: Sampler | None = None, broadcast: Callable[[Any], None] | None = None,
        kv_layout: KVLayout | None = None,
    ) -> None:
        """``arch`` is the shape the model holds (a tensor-parallel rank's part); ``num_blocks``
        the KV blocks of each slot of ``kv_layout`` (one group of every layer when None). The
        driver (rank 0, or the only rank) has a ``sampler``; ``broadcast`` (the driver of a
        tensor-parallel group) sends each command to the workers first."""
        self.model = model
        self.arch = arch
        self.device = device
        self.sampler = sampler
        self.broadcast = broadcast
        set_threads(model, device)
        spec = kv_spec or KVCacheSpec(dtype)
        self.backend = select_attention_backend(device, spec, arch.head_dim, attention_backend,
                                                model.attention_features())
        scales: dict[int, tuple[float, float]] = getattr(model, "kv_scales", {})
        if spec.fp8_format is not None and not spec.per_token and len(scales) < arch.num_layers:
            logger.warning("kv_cache_scales=per_tensor: the checkpoint has no k_scale/v_scale for %d of %d "
                           "layers; using 1.0 there (vLLM's default)", arch.num_layers - len(scales),
                           arch.num_layers)
        block = hadamard(arch.head_dim)[1]
        if spec.kv_bits is not None and spec.rotate and block < arch.head_dim:
            logger.info("head_dim %d is not a power of two: the %s cache rotates K/V by a block-diagonal "
                        "Hadamard matrix of %d-wide blocks", arch.head_dim, spec.format, block)
        self.layout = kv_layout or KVLayout.plan([None] * arch.num_layers)
        self.layer_groups = [g for g, _ in self.layout.slot_of()]
        if len(self.layout.groups) == 1:
            self.caches = [make_layer_kv(spec, num_blocks, arch.num_kv_heads, arch.head_dim, device, scales.get(i))
                           for i in range(arch.num_layers)]
        else:  # layer j of every group shares slot j's storage
            slots = [make_layer_kv(spec, num_blocks, arch.num_kv_heads, arch.head_dim, device)
                     for _ in range(self.layout.slots)]
            self.caches = [layer_view(slots[j], scales.get(i)) for i, (_, j) in enumerate(self.layout.slot_of())]
        if getattr(model, "decode_stack", None) is not None and (why := unfit_reason_for(self.backend, spec)):
            logger.debug("decode steps run layer by layer in Python: %s", why)
            model.decode_stack = None

    @torch.inference_mode()
    def calibrate_kv_shifts(self, token_ids: list[int]) -> None:
        """Set each layer's K/V shifts to their per-channel means over ``token_ids`` (a
        forward pass into a scratch cache in the model dtype; the real cache is untouched)."""
        if self.broadcast is not None:
            self.broadcast(("calibrate", token_ids))
        n = len(token_ids)
        nb = -(-n // BLOCK_SIZE)
        spec = KVCacheSpec(self.caches[0].dtype)
        scratch = [make_layer_kv(spec, nb, self.arch.num_kv_heads, self.arch.head_dim, self.device)
                   for _ in range(self.arch.num_layers)]
        means: list[tuple[torch.Tensor, torch.Tensor]] = []
        inner = select_attention_backend(self.device, spec, self.arch.head_dim, "torch",
                                         self.model.attention_features())

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
        self.model(torch.tensor(token_ids, device=self.device), pos, scratch, [meta] * len(scratch), recorder)
        for cache, (k_mean, v_mean) in zip(self.caches, means, strict=True):
            cache.set_shifts(k_mean, v_mean)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step and sample: token ids and logprobs of the sampling rows, and the
        prompt logprobs asked for."""
        assert self.sampler is not None, "only the driver samples"
        step = self.logits(out)
        result = StepResult(sample_requests=[s.request for s in step.sample_requests])
        for s in out.scheduled:
            if s.request.request_id in step.prompt_logits:
                first, lg = step.prompt_logits[s.request.request_id]
                result.prompt_logprobs[s.request.request_id] = (first, prompt_logprobs(s, first, lg))
        if step.logits is not None:
            result.sample_requests, result.sampled, result.failed_rows = self.sampler.verify(
                step.logits, [s.request for s in step.sample_requests],
                [s.draft_token_ids for s in step.sample_requests], [s.token_mask for s in step.sample_requests])
        return result

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> StepLogits:
        """Run one step; its logits (the sampling rows' and those asked for prompt logprobs)."""
        decodes = sorted((s for s in out.scheduled if s.num_tokens == 1 or s.draft_token_ids),
                         key=lambda s: -(s.request.num_computed_tokens + len(s.draft_token_ids)))
        prefills = [s for s in out.scheduled if s.num_tokens > 1 and not s.draft_token_ids]
        batch = StepInputs()
        self._prepare_decodes(decodes, batch)
        self._prepare_prefills(prefills, batch)
        step = self._plan_logits(decodes + prefills, batch)
        if self.broadcast is not None:
            self.broadcast(("step", batch))
        logits = self.run(batch)
        if step.sample_requests:
            step.logits = logits.pop()
        for rid, (first, _) in step.prompt_logits.items():
            step.prompt_logits[rid] = (first, logits.pop(0))
        return step

    @torch.inference_mode()
    def run(self, batch: StepInputs) -> list[torch.Tensor]:
        """Run the model on one step's inputs; the fp32 CPU logits of each ``logit_rows`` entry
        (empty on a tensor-parallel worker: rank 0 gathers them)."""
        dev = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
        positions = torch.cat(batch.positions).to(dev)
        metas = [self.backend.build_metadata(AttentionBatch(torch.cat(g.slots).to(dev), g.decodes, g.prefills), dev)
                 for g in batch.groups]
        hidden = self.model(input_ids, positions, self.caches, [metas[g] for g in self.layer_groups], self.backend)
        out = []
        for rows in batch.logit_rows:
            logits = self.model.compute_logits(hidden[rows.to(hidden.device)])
            if logits is not None:
                out.append(logits.float().cpu())
        return out

    def _prepare_decodes(self, decodes: list[ScheduledRequest], batch: StepInputs) -> None:
        """Decodes are ordered longest context first (the caller keeps this order for the
        logits); each row's block table holds the blocks its context uses. A request with draft
        tokens is one decode row per token (its last, then each draft) at consecutive
        positions: each row attends to its own context, which the rows before it in the step
        extend (every row's K/V is written before attention), so the rows get the bits one-row
        decodes would, and all-decode steps keep the fused decode path."""
        if not decodes:
            return
        pos: list[int] = []
        slots: list[list[int]] = []
        for s in decodes:
            p = s.request.num_computed_tokens
            tokens = [s.request.all_token_ids[p], *s.draft_token_ids]
            _decode_rows(batch, pos, slots, tokens, p, s.block_tables)
        _append_decodes(batch, pos, slots)

    def _prepare_prefills(self, prefills: list[ScheduledRequest], batch: StepInputs) -> None:
        for s in prefills:
            start = s.request.num_computed_tokens
            _prefill_rows(batch, s.request.all_token_ids[start:start + s.num_tokens], start, s.block_tables)

    @torch.inference_mode()
    def decode_logits(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Run each of ``seqs`` (token ids, position of the first, block table) as decode rows,
        one per token at consecutive positions, as a step runs a request's drafts; the fp32
        logits of each sequence's last row, in the order given. A draft model's runner runs its
        steps here (one rank, one KV group, no sampler)."""
        order = sorted(range(len(seqs)), key=lambda i: -(seqs[i][1] + len(seqs[i][0])))
        batch = StepInputs()
        pos: list[int] = []
        slots: list[list[int]] = []
        last: list[int] = []
        for i in order:
            tokens, start, table = seqs[i]
            _decode_rows(batch, pos, slots, tokens, start, [table])
            last.append(len(pos) - 1)
        _append_decodes(batch, pos, slots)
        batch.logit_rows.append(torch.tensor(last, dtype=torch.long))
        logits = self.run(batch)[0]
        out = torch.empty_like(logits)
        out[torch.tensor(order)] = logits
        return out

    @torch.inference_mode()
    def prefill(self, tokens: list[int], start: int, table: list[int]) -> None:
        """Write the K/V of ``tokens`` at positions from ``start`` on (one prefill chunk, no logits)."""
        batch = StepInputs()
        _prefill_rows(batch, tokens, start, [table])
        self.run(batch)

    @staticmethod
    def _plan_logits(ordered: list[ScheduledRequest], batch: StepInputs) -> StepLogits:
        """Which rows' logits the step needs: each prompt-logprobs chunk, then the sampled rows
        (``batch.logit_rows`` in that order); the returned step's logits are filled by ``execute``."""
        step = StepLogits()
        rows: list[int] = []
        row = 0
        for s in ordered:
            req = s.request
            if req.params.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens - 1:
                # Positions p in this chunk with p + 1 a prompt token predict that token.
                first = req.num_computed_tokens
                last = min(first + s.num_tokens, req.num_prompt_tokens - 1)
                batch.logit_rows.append(torch.arange(row, row + last - first))
                step.prompt_logits[req.request_id] = (first, torch.empty(0))
            if s.samples:  # the last row, or with drafts the last known token's row and theirs
                rows.extend(range(row + s.num_tokens - 1 - len(s.draft_token_ids), row + s.num_tokens))
                step.sample_requests.append(s)
            row += s.num_tokens
        if rows:
            batch.logit_rows.append(torch.tensor(rows, dtype=torch.long))
        return step


def _decode_rows(batch: StepInputs, pos: list[int], slots: list[list[int]], tokens: list[int], start: int,
                 tables: list[list[int]]) -> None:
    """Append ``tokens`` as decode rows at positions ``start``, ``start + 1``, ...: each row's
    block table (one per KV group) holds the blocks its own context uses."""
    batch.input_ids.extend(tokens)
    while len(slots) < len(tables):
        slots.append([])
    for q in range(start, start + len(tokens)):
        for g, table in enumerate(tables):
            batch.group(g).decodes.append(SeqSpan(len(pos), len(pos) + 1, q + 1, table[: q // BLOCK_SIZE + 1]))
            slots[g].append(table[q // BLOCK_SIZE] * BLOCK_SIZE + q % BLOCK_SIZE)
        pos.append(q)


def _append_decodes(batch: StepInputs, pos: list[int], slots: list[list[int]]) -> None:
    batch.positions.append(torch.tensor(pos, dtype=torch.long))
    for g, group_slots in enumerate(slots):
        batch.group(g).slots.append(torch.tensor(group_slots, dtype=torch.long))


def _prefill_rows(batch: StepInputs, tokens: list[int], start: int, tables: list[list[int]]) -> None:
    """Append ``tokens`` as one prefill chunk at positions from ``start`` on."""
    row, ctx = len(batch.input_ids), start + len(tokens)
    batch.input_ids.extend(tokens)
    pos = torch.arange(start, ctx, dtype=torch.long)
    batch.positions.append(pos)
    for g, table in enumerate(tables):
        blocks = torch.tensor(table, dtype=torch.long)
        group = batch.group(g)
        group.slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        group.prefills.append(SeqSpan(row, ctx - start + row, ctx, list(table)))


def prompt_logprobs(s: ScheduledRequest, first: int, logits: torch.Tensor) -> list[dict[int, Logprob]]:
    """Row r of ``logits`` predicts the prompt token at ``first + r + 1``: its logprob and rank
    with the top ``prompt_logprobs`` tokens."""
    lp = torch.log_softmax(logits, dim=-1)
    ids, k = s.request.all_token_ids, s.request.params.prompt_logprobs or 0
    return [top_logprobs(lp[r], ids[first + r + 1], k) for r in range(lp.shape[0])]


def set_threads(model: Any, device: torch.device) -> None:
    """The one thread policy of a process that runs a model (the engine's, or a rank's on its
    own cores): torch takes the chosen ops' thread count (``layers.ops``); on CPU NumPy's BLAS
    keeps one thread where the block-format kernels run their own (two spinning pools on the
    same cores slow each other, ``kernels.cpu.matmul.blas``), else its starting size."""
    if model.ops.torch_threads is not None:
        torch.set_num_threads(model.ops.torch_threads)
    if device.type == "cpu":
        blas.set_threads(1 if model.runs_own_threads() else None)
