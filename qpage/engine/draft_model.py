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
from qpage.engine.speculative import Drafter, StepCost
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.models.arch import ArchConfig
from qpage.models.loader import load_model, read_arch_config, resolve_model_dir
from qpage.runner.model_runner import ModelRunner


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

    def build(self, dtype: torch.dtype, device: torch.device, max_model_len: int, num_blocks: int,
              kv_spec: KVCacheSpec, attention_backend: str) -> ModelRunner:
        """The draft model on ``device``, kept in its blocks, with its half of every KV block."""
        model = load_model(self.path, self.arch, dtype, device, max_model_len, requantize=self.requantize)
        return ModelRunner(model, self.arch, num_blocks, dtype, device, kv_spec=kv_spec,
                           attention_backend=attention_backend)


def check_tokenizers(draft: Any, target: Any, name: str) -> None:
    """Raise ValueError unless the two tokenizers map the same strings to the same ids."""
    if draft.get_vocab() != target.get_vocab():
        raise ValueError(f"speculative_config model={name!r}: its tokenizer differs from the target's; a draft "
                         "model must share the target's vocabulary")


class ModelDrafter(Drafter):
    """Drafts with a model (``DraftSource``): each draft step costs time, so a token pays when
    it is accepted more often than one more target row plus one draft step cost, over the
    target's step (both measured)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner: ModelRunner, kv: KVCacheManager,
                 chunk: int, vocab_size: int) -> None:
        """``chunk``: most prompt tokens per catch-up prefill; ``vocab_size``: the target's
        (a draft's padded vocabulary never proposes past it)."""
        super().__init__(config, max_model_len)
        self.runner = runner
        self.kv = kv
        self.chunk = chunk
        self.vocab_size = vocab_size
        self.draft_cost = StepCost()
        self.progress: weakref.WeakKeyDictionary[Request, tuple[int, int]] = weakref.WeakKeyDictionary()
        """Request -> (its preemptions then, leading positions of the draft's cache that are right)."""
        runner.decode_logits([([0], 0, [0])])  # the first step's one-time setup is not a draft step's cost

    def threshold(self, rows: int) -> float:
        """A draft token's cost over the target's step: one more target row and one draft step."""
        share = self.cost.row_share(rows)
        draft, target = self.draft_cost.step_seconds(rows), self.cost.step_seconds(rows)
        return share + (draft / target if draft is not None and target is not None else 0.0)

    def propose(self, reqs: list[Request]) -> None:
        """Set the drafts of ``reqs``, the requests about to decode (last token not yet cached)."""
        plan: list[tuple[Request, int]] = []
        for req, k in zip(reqs, self.lengths(reqs, self.threshold(len(reqs))), strict=True):
            req.draft_token_ids = []
            k = self._reserve(req, k) if k > 0 else 0
            if k > 0:
                plan.append((req, k))
        if not plan:
            return
        drafts = self._draft(plan)
        for (req, k), toks in zip(plan, drafts, strict=True):
            req.draft_token_ids = toks
            self.progress[req] = (req.num_preemptions, req.num_tokens + k - 1)

    def _reserve(self, req: Request, k: int) -> int:
        """Blocks for the verification of ``k`` drafts (which the draft writes first); where
        there are too few free, as many drafts as the request's blocks hold."""
        if self.kv.allocate_slots(req, 1 + k) is None:
            k = min(k, len(self.kv.block_ids(req.request_id)) * BLOCK_SIZE - req.num_tokens)
        return k

    def _catch_up(self, req: Request) -> int:
        """Fill the draft's cache up to a few positions before the request's last token (a
        prompt, in prefill chunks); the first position the draft steps must still compute."""
        pre, right = self.progress.get(req, (-1, 0))
        start = min(right, req.num_tokens - 1) if pre == req.num_preemptions else 0
        end = req.num_tokens - 1 - self.config.num_speculative_tokens
        table = self.kv.block_ids(req.request_id)
        while start < end:
            n = min(self.chunk, end - start)
            self.runner.prefill(req.all_token_ids[start:start + n], start, table)
            start += n
        return start

    def _draft(self, plan: list[tuple[Request, int]]) -> list[list[int]]:
        """Greedy draft tokens of every request in ``plan``, all requests stepping together."""
        seqs = [(req.all_token_ids[s:], s, self.kv.block_ids(req.request_id))
                for req, s in ((req, self._catch_up(req)) for req, _ in plan)]
        out: list[list[int]] = [[] for _ in plan]
        live = list(range(len(plan)))
        while live:
            t0 = time.perf_counter()
            logits = self.runner.decode_logits([seqs[i] for i in live])
            self.draft_cost.observe(sum(len(seqs[i][0]) for i in live), time.perf_counter() - t0)
            best = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for i, tok in zip(live, best, strict=True):
                out[i].append(tok)
                _, start, table = seqs[i]
                seqs[i] = ([tok], start + len(seqs[i][0]), table)
            live = [i for i in live if len(out[i]) < plan[i][1]]
        return out
