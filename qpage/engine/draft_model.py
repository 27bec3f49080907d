"""Speculative decoding with a draft model: a smaller model with the target's tokenizer, or the
target itself requantized at load (``self:q4_0``), drafting greedily on its own paged KV cache.

The draft's cache mirrors the target's: the same block ids, each block holding the draft's
K/V beside the target's (the engine sizes blocks for both models from one budget), so the
target's allocation, prefix caching, preemption and freeing serve the draft unchanged. The
drafter allocates the blocks the next verification needs before it drafts, and the draft
writes only there. What the draft writes decides how many drafts the target keeps, never the
output: the target verifies every token (``runner.sampler.Sampler.verify``), and a greedy
draft is a point-mass proposal, so sampled requests keep the target's distribution too.

Per request the drafter remembers how many leading positions of the draft's cache are right
(computed since the request's last preemption, from tokens the request still has). A proposal
catches up from there (a prompt as prefill chunks, the tokens kept by the last verification as
decode rows), then runs greedy decode steps for all drafting requests together. A new request
computes its prompt in the draft even where the target found it in the prefix cache: a cached
block's draft half may hold another request's rejected drafts.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qpage.config import BLOCK_SIZE, SpeculativeConfig
from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request
from qpage.engine.speculative import Drafter, NgramDrafter, SpeculationStats, StepCost
from qpage.engine.tokenizers import check_same_vocabulary, load_tokenizer
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.models.arch import ArchConfig
from qpage.models.loader import load_model, read_arch_config, resolve_model_dir
from qpage.runner.model_runner import ModelRunner
from qpage.runner.tp_workers import RankSetup


@dataclass(frozen=True)
class DraftSource:
    """Where the draft model comes from: a file or folder, its shape, and the block format the
    target is requantized to for a ``self:`` draft (None: the draft's own weights)."""

    path: Path
    arch: ArchConfig
    requantize: str | None
    name: str

    @classmethod
    def resolve(cls, config: SpeculativeConfig, target_dir: Path, target: ArchConfig) -> DraftSource:
        """The draft ``config.model`` names, checked against the target's shape."""
        assert config.model is not None
        fmt = config.self_format
        if fmt is not None:
            quant = (target.quantization or {}).get("quant_method")
            if quant not in (None, "gguf"):
                raise ValueError(f"speculative_config model={config.model!r}: the target is a {quant} checkpoint; "
                                 "a self draft is made from float or GGUF weights. Give a draft model file instead")
            return cls(target_dir, target, fmt, config.model)
        path = resolve_model_dir(config.model)
        arch = read_arch_config(path)
        if arch.vocab_size < target.vocab_size:
            raise ValueError(f"speculative_config model={config.model!r}: its vocabulary has {arch.vocab_size} "
                             f"tokens, the target's {target.vocab_size}; a draft needs the target's tokenizer")
        return cls(path, arch, None, path.name)

    def kv_bytes_per_token(self, spec: KVCacheSpec) -> int:
        return spec.bytes_per_token(self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim)

    def build(self, setup: RankSetup, device: torch.device) -> ModelRunner:
        """The draft model on ``device``, kept in its blocks, with its half of every KV block
        (``setup``: the target's dtype, context, blocks, KV format and attention backend)."""
        model = load_model(self.path, self.arch, setup.dtype, device, setup.max_model_len,
                           requantize=self.requantize)
        return ModelRunner(model, self.arch, setup.num_blocks, setup.dtype, device, kv_spec=setup.kv_spec,
                           attention_backend=setup.attention_backend)


def catch_up_pays(rate: float, k: int, threshold: float, tokens_left: int, token_seconds: float,
                  catch_up_seconds: float) -> bool:
    """Whether ``k`` draft tokens a step at acceptance ``rate``, each costing ``threshold`` of a
    token's time (``token_seconds``: the target's step over its rows), save more over the
    request's next ``tokens_left`` tokens than a catch-up of ``catch_up_seconds`` costs."""
    kept = sum(rate ** i for i in range(1, k + 1))
    steps = tokens_left / (1 + kept)
    return (kept - k * threshold) * steps * token_seconds > catch_up_seconds


def draft_source(spec: SpeculativeConfig | None, target_dir: Path, target: ArchConfig, tensor_parallel: int,
                 tokenizer: Any) -> DraftSource | None:
    """The draft model ``spec`` names, if any, checked: one rank, the target's vocabulary."""
    if spec is None or spec.method != "draft_model":
        return None
    if tensor_parallel > 1:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only; use "
                         "{'method': 'ngram'} with tensor parallelism")
    draft = DraftSource.resolve(spec, target_dir, target)
    if draft.requantize is None:
        check_same_vocabulary(load_tokenizer(draft.path), tokenizer, draft.name)
    return draft


class ModelDrafter(Drafter):
    """Drafts with a model (``DraftSource``): each draft step costs time, so a token pays when
    it is accepted more often than one more target row plus one draft step cost, over the
    target's step (both measured). A request whose draft cache is behind (its prompt, or the
    tokens of steps it did not draft in) must first catch up, which costs a prefill of the
    gap: it does so only where its expected gain over the tokens it may still make (at most
    ``HORIZON``) pays for that (``_pays_catch_up``)."""

    HORIZON = 256
    """Most future tokens a catch-up is paid back over (a request may end long before its
    max_tokens)."""

    def __init__(self, config: SpeculativeConfig, source: DraftSource, setup: RankSetup, device: torch.device,
                 kv: KVCacheManager, chunk: int) -> None:
        """The draft of ``source`` built beside the target that ``setup`` describes; ``chunk``:
        most prompt tokens per catch-up prefill."""
        super().__init__(config, setup.max_model_len)
        self.source = source
        self.runner = source.build(setup, device)
        self.kv_bytes_per_token = source.kv_bytes_per_token(setup.kv_spec)
        self.kv = kv
        self.chunk = chunk
        self.vocab_size = setup.arch.vocab_size
        """The target's: a draft's padded vocabulary never proposes past it."""
        self.draft_cost = StepCost(span=1 + config.num_speculative_tokens)
        self.overall = SpeculationStats()
        """Every request's drafts together: a new request's prior (a draft model's acceptance
        is much the same from one request to the next)."""
        self.catch_up_seconds: float | None = None
        """Seconds per token of a catch-up prefill (a moving average)."""
        self.progress: weakref.WeakKeyDictionary[Request, tuple[int, int]] = weakref.WeakKeyDictionary()
        """Request -> (its preemptions then, leading positions of the draft's cache that are right)."""
        self.runner.decode_logits([([0], 0, [0])])  # the first step's one-time setup is not a draft step's cost

    def describe(self) -> str:
        mib = sum(m.weight_bytes for m in self.runner.model.quant_linears()) / 2**20
        return (f"draft {self.source.name} ({self.source.arch.num_layers} layers, {mib:.0f} MiB quantized, "
                f"{self.kv_bytes_per_token} B/token of KV in each block), "
                f"up to {self.config.num_speculative_tokens} tokens")

    def threshold(self, rows: int) -> float:
        """A draft token's cost over the target's step: one more target row and one draft step."""
        share = self.cost.row_share(rows)
        draft, target = self.draft_cost.step_seconds(rows), self.cost.step_seconds(rows)
        return share + (draft / target if draft is not None and target is not None else 0.0)

    def prior_rate(self) -> float:
        return self.overall.rate

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        super().record(req, drafted, accepted)
        self.overall.record(drafted, accepted, decay=0.99)

    def propose(self, reqs: list[Request]) -> None:
        """Set the drafts of ``reqs``, the requests about to decode (last token not yet cached)."""
        plan: list[tuple[Request, int]] = []
        threshold = self.threshold(len(reqs))
        step = self.cost.step_seconds(len(reqs))
        token_seconds = step / len(reqs) if step is not None and reqs else None
        for req, k in zip(reqs, self.lengths(reqs, threshold), strict=True):
            req.draft_token_ids = []
            if k > 0 and not self._pays_catch_up(req, k, threshold, token_seconds):
                k = 0
            k = self._reserve(req, k) if k > 0 else 0
            if k > 0:
                plan.append((req, k))
        if not plan:
            return
        drafts = self._draft(plan)
        for (req, _), toks in zip(plan, drafts, strict=True):
            req.draft_token_ids = toks
            self.progress[req] = (req.num_preemptions, req.num_tokens + len(toks) - 1)

    def _reserve(self, req: Request, k: int) -> int:
        """Blocks for the verification of ``k`` drafts (which the draft writes first); where
        there are too few free, as many drafts as the request's blocks hold."""
        if self.kv.allocate_slots(req, 1 + k) is None:
            k = min(k, len(self.kv.block_ids(req.request_id)) * BLOCK_SIZE - req.num_tokens)
        return k

    def _catch_up_span(self, req: Request) -> tuple[int, int]:
        """[start, end): the positions a catch-up prefill computes for ``req`` before its draft
        steps (those steps compute the last few themselves, as decode rows)."""
        pre, right = self.progress.get(req, (-1, 0))
        start = min(right, req.num_tokens - 1) if pre == req.num_preemptions else 0
        return start, req.num_tokens - 1 - self.config.num_speculative_tokens

    def _pays_catch_up(self, req: Request, k: int, threshold: float, token_seconds: float | None) -> bool:
        """Whether drafting ``k`` tokens a step pays for ``req``'s catch-up prefill
        (``catch_up_pays``; ``token_seconds``: the target's step over its rows); True when there
        is nothing to catch up, or nothing measured yet."""
        start, end = self._catch_up_span(req)
        if end <= start or self.catch_up_seconds is None or token_seconds is None:
            return True
        left = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens, self.HORIZON)
        return catch_up_pays(min(self.request_stats(req).rate, 0.99), k, threshold, left, token_seconds,
                             (end - start) * self.catch_up_seconds)

    def _catch_up(self, req: Request) -> int:
        """Fill the draft's cache up to a few positions before the request's last token (a
        prompt, in prefill chunks); the first position the draft steps must still compute."""
        start, end = self._catch_up_span(req)
        table = self.kv.block_ids(req.request_id)
        first, t0 = start, time.perf_counter()
        while start < end:
            n = min(self.chunk, end - start)
            self.runner.prefill(req.all_token_ids[start:start + n], start, table)
            start += n
        if start > first:
            per_token = (time.perf_counter() - t0) / (start - first)
            old = self.catch_up_seconds
            self.catch_up_seconds = per_token if old is None else 0.8 * old + 0.2 * per_token
        return start

    def _draft(self, plan: list[tuple[Request, int]]) -> list[list[int]]:
        """Greedy draft tokens of every request in ``plan``, all requests stepping together; a
        constrained request's drafts end before the first token its grammar refuses."""
        seqs = [(req.all_token_ids[s:], s, self.kv.block_ids(req.request_id))
                for req, s in ((req, self._catch_up(req)) for req, _ in plan)]
        out: list[list[int]] = [[] for _ in plan]
        live = list(range(len(plan)))
        try:
            while live:
                t0 = time.perf_counter()
                logits = self.runner.decode_logits([seqs[i] for i in live])
                self.draft_cost.observe(sum(len(seqs[i][0]) for i in live), time.perf_counter() - t0)
                best = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
                refused = set()
                for i, tok in zip(live, best, strict=True):
                    guide = plan[i][0].guide
                    if guide is not None and not guide.accept(tok):
                        refused.add(i)
                        continue
                    out[i].append(tok)
                    _, start, table = seqs[i]
                    seqs[i] = ([tok], start + len(seqs[i][0]), table)
                live = [i for i in live if i not in refused and len(out[i]) < plan[i][1]]
        finally:
            for (req, _), toks in zip(plan, out, strict=True):
                if req.guide is not None:  # the grammar moves only by tokens the target keeps
                    req.guide.rollback(len(toks))
        return out


def make_drafter(spec: SpeculativeConfig | None, draft: DraftSource | None, setup: RankSetup,
                 device: torch.device, kv: KVCacheManager, chunk: int) -> Drafter | None:
    """The drafter ``spec`` asks for (None without speculation): n-gram lookup, or ``draft``
    built beside the target that ``setup`` describes."""
    if spec is None:
        return None
    if draft is None:
        return NgramDrafter(spec, setup.max_model_len)
    return ModelDrafter(spec, draft, setup, device, kv, chunk)
