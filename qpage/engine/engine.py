"""The engine: input processing, the step loop (schedule -> run -> sample -> update), outputs."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from qpage.config import EngineConfig
from qpage.engine.detokenizer import IncrementalDetokenizer
from qpage.engine.draft_model import ModelDrafter, draft_source, make_drafter
from qpage.engine.kv_cache import KVCacheManager, plan_cache
from qpage.engine.metrics import EngineMetrics
from qpage.engine.output_processor import OutputProcessor, ParentState
from qpage.engine.outputs import CompletionOutput, RequestOutput
from qpage.engine.request import Request, RequestStatus
from qpage.engine.scheduler import Scheduler
from qpage.engine.structured import GrammarCompiler, Guide, MaskBudget, token_masks
from qpage.engine.tokenizers import eos_token_ids, load_tokenizer
from qpage.layers.attention.kv_calibration import CALIBRATION_TEXT
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.linear.block_linear import BlockLinear
from qpage.layers.linear.embedding import Embedding
from qpage.layers.moe import SparseMoe, describe_experts
from qpage.models.loader import read_arch_config, resolve_dtype, resolve_model_dir
from qpage.models.sharding import check_parallel, plan_shards
from qpage.parallel.comm import Collectives, TensorParallelError
from qpage.runner.batch import SchedulerOutput
from qpage.runner.sampler import Sampler
from qpage.runner.tp_workers import RankReport, RankSetup, Workers, build_rank, rank_device
from qpage.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
T = TypeVar("T")
log = logging.getLogger("qpage.engine")


def check_prompt_ids(ids: object, max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError unless ``ids`` is a non-empty list of token ids that leaves room in the
    context for at least one new token (the one rule for the engine and the server)."""
    if not isinstance(ids, list):
        raise ValueError(f"prompt_token_ids must be a list of ints in [0, {vocab_size})")
    if not ids:
        raise ValueError("the prompt is empty; give at least one token of text")
    if len(ids) >= max_model_len:  # before the per-id check: a huge list fails at once
        raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {max_model_len}: "
                         "shorten the prompt or raise max_model_len (and kv_cache_memory)")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt_token_ids must be a list of ints in [0, {vocab_size})")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.model_dir = resolve_model_dir(mc.model)
        self.arch = read_arch_config(self.model_dir)
        tp = config.parallel.tensor_parallel_size
        check_parallel(self.arch, tp, str(self.model_dir))
        self.device = torch.device(rank_device(mc.device, tp, 0))
        self.dtype = resolve_dtype(mc.dtype, self.arch, self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.mask_budget = MaskBudget()
        cc = config.cache
        self.kv_spec = KVCacheSpec.from_config(cc.kv_cache_dtype, cc.kv_cache_scales, self.dtype, cc.kv_cache_rotation)
        # Each rank holds its KV heads for every block: the blocks are sized for the rank with most.
        kv_heads = max(p.kv_heads[1] - p.kv_heads[0] for p in plan_shards(self.arch, tp))
        kv_arch = dataclasses.replace(self.arch, num_kv_heads=kv_heads)
        self.draft = draft_source(config.speculative_config, self.model_dir, self.arch, tp, self.tokenizer)
        draft_bytes = self.draft.kv_bytes_per_token(self.kv_spec) if self.draft is not None else 0
        cache = plan_cache(self.arch, kv_arch, self.kv_spec, int(cc.kv_cache_memory), mc.max_model_len,
                           config.scheduler.max_num_batched_tokens, draft_bytes)
        if any(g.window is not None for g in cache.layout.groups) and self.draft is not None:
            raise ValueError(f"{self.model_dir}: a draft model is not supported yet with sliding-window layers "
                             "(their given-back blocks would hold no draft K/V); use ngram speculation")
        self.layout, self.max_model_len, num_blocks = cache.layout, cache.max_model_len, cache.num_blocks
        self.kv = KVCacheManager(num_blocks, config.cache.enable_prefix_caching, self.layout)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.workers: Workers | None = None
        self.rank_reports: list[RankReport] = []
        """With tensor parallelism: what each rank holds (weights, KV bytes and heads)."""
        setup = RankSetup(self.model_dir, self.arch, self.dtype, mc.device, self.max_model_len, num_blocks,
                          self.kv_spec, mc.attention_backend, mc.allow_pickle, mc.dequantize_weights, self.layout)
        if tp == 1:
            self.runner, _ = build_rank(setup, Collectives.solo(), self._sampler())
            self.model = self.runner.model
        else:
            self._start_ranks(setup)
        self.drafter = make_drafter(config.speculative_config, self.draft, setup, self.device, self.kv,
                                    config.scheduler.max_num_batched_tokens)
        if self.kv_spec.centered:
            ids = self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)[: min(512, self.max_model_len)]
            self._run_ranks(lambda: self.runner.calibrate_kv_shifts(ids))
            if isinstance(self.drafter, ModelDrafter):
                self.drafter.runner.calibrate_kv_shifts(ids)
        self.metrics = EngineMetrics()
        self.outputs = OutputProcessor(self.tokenizer, self.metrics)
        self._ids = itertools.count()
        self._requests: dict[str, list[Request]] = {}
        if config.log_stats:
            print(
                f"qpage: {self.model_dir.name} ({self.arch.architecture}, {self.dtype}) on "
                f"{self.device}; KV cache {self.kv_spec.describe()}, {cache.describe(self.arch.num_layers)}; "
                f"attention {self.runner.backend.name}; "
                f"max_model_len {self.max_model_len}{self._quantized_note()}{describe_experts(self.model)}"
                f"{self._parallel_note()}"
                f"{self._speculative_note()}",
                flush=True,
            )

    def _speculative_note(self) -> str:
        """'; speculative decoding: ...' for the start line (empty without it)."""
        return "" if self.drafter is None else f"; speculative decoding: {self.drafter.describe()}"

    def _start_ranks(self, setup: RankSetup) -> None:
        """Start the tensor-parallel group: the workers build their parts while this process
        (rank 0) builds its own; raise the first rank's load error, if any."""
        pc = self.config.parallel
        self.workers = Workers(pc.tensor_parallel_size, pc.distributed_timeout, str(self.device))
        self._finalizer = weakref.finalize(self, self.workers.close)  # workers stop when this engine goes
        comm = self.workers.comm
        try:
            comm.broadcast(setup, pc.distributed_timeout)
            runner, own = build_rank(setup, comm, self._sampler(), self.workers.send)
        except BaseException:
            self.workers.close(force=True)  # the workers may be building still, or waiting to report
            raise
        self.rank_reports = [own, *(self._run_ranks(lambda: comm.gather_objects(own)) or [])[1:]]
        errors = [f"rank {r.rank}: {r.error}" for r in self.rank_reports if r.error]
        if errors:
            self.workers.close()
            raise ValueError("; ".join(errors))
        self.runner, self.model = runner, runner.model

    def _sampler(self) -> Sampler:
        return Sampler(self.config.seed, processed_logprobs=self.config.logprobs_mode == "processed_logprobs")

    def _run_ranks(self, fn: Callable[[], T]) -> T:
        """``fn()``; with tensor parallelism any error inside it ends the group (the ranks may be
        out of step) as a TensorParallelError naming the dead or silent rank, or the cause."""
        if self.workers is None:
            return fn()
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as e:
            raise self.workers.failure(e) from e

    def _parallel_note(self) -> str:
        """'; tensor parallel N ranks: ...' for the start line (empty with one rank)."""
        if not self.rank_reports:
            return ""
        mib = "/".join(f"{r.weight_bytes / 2**20:.0f}" for r in self.rank_reports)
        kv = "/".join(f"{r.kv_bytes / 2**20:.0f}" for r in self.rank_reports)
        heads = "/".join(str(r.kv_heads) for r in self.rank_reports)
        backend = self.workers.comm.backend if self.workers else ""
        return (f"; tensor parallel {len(self.rank_reports)} ranks ({backend}): weights "
                f"{mib} MiB, KV cache {kv} MiB ({heads} of {self.arch.num_kv_heads} KV heads) per rank")

    def shutdown(self, force: bool = False) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or
        the process exits); ``force`` kills them without a word (a step may still be running)."""
        if self.workers is not None:
            self.workers.close(force)
            self.workers = None

    def _quantized_note(self) -> str:
        """'; quantized linears: ...' for the start line (empty for a dense model)."""
        mods = self.model.quant_linears()
        if not mods:
            return ""
        paths = self.kernel_paths()["quantized_linears"]
        mib = sum(m.weight_bytes for m in mods) / 2**20
        note = f"; quantized linears: {', '.join(f'{n} {p}' for p, n in sorted(paths.items()))} ({mib:.0f} MiB)"
        embed = next(m for m in self.model.modules() if isinstance(m, Embedding))
        if embed.packed:  # a GGUF embedding, kept in its blocks where a kernel reads them
            note += f", embedding {embed.kernel_path} ({embed.weight_bytes / 2**20:.0f} MiB)"
        if self.model.decode_stack is not None:
            note += "; decode steps in one C call"
        dequantized = paths.get("cpu-dequantized", 0) + paths.get("dequantized-fallback", 0)
        if dequantized and self.config.model.dequantize_weights:
            note += " - dequantized on request (dequantize_weights); the packed kernels hold a fraction of this"
        elif dequantized and isinstance(mods[0], BlockLinear):
            note += (f" - {dequantized} layers hold dequantized copies: no packed kernel runs their formats on this "
                     "device (the 'qpage' logger says why at DEBUG level)")
        elif dequantized:
            note += (f" - {dequantized} layers dequantized: no packed kernel runs them (the 'qpage' logger says "
                     "why at DEBUG level)")
        return note

    # ------------------------------------------------------------------ input
    def _prompt_ids(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            text: str | None = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"], add_special_tokens)
        else:
            raise ValueError(
                f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        check_prompt_ids(ids, self.max_model_len, self.arch.vocab_size)
        return text, list(ids)

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None,
        request_id: str | None = None, add_special_tokens: bool = True, grammar: Any = None,
    ) -> str:
        """Queue a prompt; raise ValueError for bad input without touching other requests.
        ``grammar``: ``params.structured_outputs`` already compiled (``self.grammars.compile``),
        as the server passes it so that the step loop never compiles; None compiles it here."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt, add_special_tokens)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        so = params.structured_outputs
        if so is not None and grammar is None:
            grammar = self.grammars.compile(so)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.monotonic()
        children = [
            Request(f"{rid}-{i}" if params.n > 1 else rid, ids, params, max_tokens,
                    self.eos_token_ids, parent_id=rid, index=i, arrival_time=now,
                    guide=Guide(grammar) if so is not None else None)
            for i in range(params.n)
        ]
        want_lp = params.logprobs is not None
        self.outputs.add(ParentState(
            request_id=rid, prompt=text, prompt_token_ids=ids, params=params, children=children,
            detoks=[self._detok(ids, params) for _ in children],
            completions=[CompletionOutput(i, "", [], 0.0 if want_lp else None, [] if want_lp else None)
                         for i in range(params.n)],
        ))
        self._requests[rid] = children
        for c in children:
            self.scheduler.add_request(c)
        self.metrics.inc("prompt_tokens_total", len(ids) * params.n)
        return rid

    def _detok(self, ids: list[int], p: SamplingParams) -> IncrementalDetokenizer | None:
        if not p.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, ids, p.skip_special_tokens, p.stop_strings if p.stops_apply else [],
            p.include_stop_str_in_output
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its sequences) and free its blocks at once."""
        for req in self._requests.pop(request_id, []):
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self.outputs.parents.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the (cumulative) outputs of the requests it touched.
        schedule -> the constrained rows' token masks -> run and sample (the runner) -> for each
        new token: the grammar, the text, the one stop decision (``Request.stop_status``)."""
        sched = self.scheduler.schedule()
        self.metrics.inc("num_preemptions_total", len(sched.preempted))
        if sched.is_empty:
            self.update_gauges()
            return []
        guided = [s for s in sched.scheduled if s.samples and cast(Request, s.request).guide is not None]
        refused: dict[str, str] = {}  # parent id -> why its grammar ends it (the client's error)
        if guided:
            g_reqs = [cast(Request, s.request) for s in guided]
            masks, refused = token_masks([r.guide for r in g_reqs], self.arch.vocab_size,  # type: ignore[misc]
                                         [r.parent_id for r in g_reqs], self.mask_budget,
                                         [s.draft_token_ids for s in guided])
            row = 0
            for s in guided:  # its last token's row, then one per draft
                s.token_mask, row = masks[row:row + 1 + len(s.draft_token_ids)], row + 1 + len(s.draft_token_ids)
        t0 = time.perf_counter()
        step = self._run_ranks(lambda: self.runner.execute(sched))
        seconds = time.perf_counter() - t0
        self.mask_budget.observe(seconds)
        if self.drafter is not None and all(s.samples and s.num_tokens == 1 + len(s.draft_token_ids)
                                            for s in sched.scheduled):
            self.drafter.cost.observe(sched.num_batched_tokens, seconds)  # an all-decode step
        failed = dict(refused)  # parent request id -> why it failed (it alone ends)
        for s in sched.scheduled:
            req = cast(Request, s.request)
            if req.request_id in step.prompt_logprobs:
                first, entries = step.prompt_logprobs[req.request_id]
                try:
                    self.outputs.add_prompt_logprobs(req, first, entries)
                except Exception as e:
                    failed[req.parent_id] = f"computing its prompt logprobs failed: {type(e).__name__}: {e}"
        reqs = cast(list[Request], step.sample_requests)
        res = step.sampled
        failed.update({reqs[i].parent_id: why for i, why in step.failed_rows.items()})
        emitted = Counter(r.request_id for r in reqs)
        self.scheduler.update(sched, emitted)
        now = time.monotonic()
        for i, req in enumerate(reqs):  # a request's kept draft tokens come in order, one row each
            if req.parent_id in failed or req.status.finished:
                continue
            t = res.token_ids[i]
            if req.guide is not None and not req.guide.accept(t):  # one token at a time: it may end here
                failed[req.parent_id] = f"the structured-output grammar refused the sampled token {t}"
                continue
            req.append_token(t)
            try:
                stop_string = self.outputs.add_token(req, res, i, now)
            except Exception as e:
                failed[req.parent_id] = f"processing its output failed: {type(e).__name__}: {e}"
                continue
            ended = req.stop_status(self.max_model_len, stop_string)
            if ended is not None:
                self.scheduler.finish(req, ended)
        if self.drafter is not None:
            self._speculate(sched, emitted)
        touched = {r.parent_id for r in reqs} - failed.keys()
        return self._finish_step(self.outputs.snapshot(touched, failed), failed, set(refused))

    def _speculate(self, sched: SchedulerOutput, emitted: Counter[str]) -> None:
        """Count the step's verified drafts, then draft for every request about to decode."""
        assert self.drafter is not None
        drafts, tokens, accepted = self.drafter.verified(sched.scheduled, emitted)
        self.metrics.inc("spec_decode_num_drafts", drafts)
        self.metrics.inc("spec_decode_num_draft_tokens", tokens)
        self.metrics.inc("spec_decode_num_accepted_tokens", accepted)
        self.drafter.propose([r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1])

    def _finish_step(self, outs: list[RequestOutput], failed: dict[str, str],
                     refused: set[str]) -> list[RequestOutput]:
        """Add the failed requests' final outputs (``refused``: failed by their own doing, a
        client error), forget finished requests, refresh gauges."""
        for pid, msg in failed.items():
            log.warning("qpage: request %s failed: %s", pid, msg)
            for req in self._requests.get(pid, []):
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            out = self.outputs.failed(pid, msg, pid in refused)
            if out is not None:
                outs.append(out)
        for o in outs:
            if o.finished:
                self._requests.pop(o.request_id, None)
        self.update_gauges()
        return outs

    def update_gauges(self) -> None:
        """Refresh the running/waiting/KV-usage gauges from the scheduler (also called by the server)."""
        g = self.metrics.gauges
        g["num_requests_running"] = len(self.scheduler.running)
        g["num_requests_waiting"] = len(self.scheduler.waiting)
        g["kv_cache_usage_perc"] = self.kv.usage()
        g["kv_cache_blocks_held"] = self.kv.held_entries
        g["kv_cache_blocks_without_windows"] = self.kv.table_entries
        self.metrics.counters["prefix_cache_queries"] = self.kv.prefix_queries
        self.metrics.counters["prefix_cache_hits"] = self.kv.prefix_hits
        self.metrics.update_speculation()

    def kernel_paths(self) -> dict[str, Any]:
        """Which kernels run: the attention backend, quantized linears counted by path, and a
        mixture of experts' sparse layers counted by path (``moe_layers``)."""
        linears: dict[str, int] = {}
        for mod in self.model.quant_linears():
            linears[mod.kernel_path] = linears.get(mod.kernel_path, 0) + 1
        experts: dict[str, int] = {}
        for mod in self.model.modules():
            if isinstance(mod, SparseMoe):
                experts[mod.experts_path] = experts.get(mod.experts_path, 0) + 1
        return {"attention_backend": self.runner.backend.name, "device": self.device.type,
                "quantized_linears": linears, **({"moe_layers": experts} if experts else {})}

    def get_metrics(self) -> dict[str, Any]:
        self.update_gauges()
        return self.metrics.snapshot()
