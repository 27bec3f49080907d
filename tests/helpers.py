"""Shared test helpers: drive the model runner directly, without a tokenizer or scheduler."""

from __future__ import annotations

from pathlib import Path

import torch

from qpage.engine.kv_cache import KVCacheManager
from qpage.engine.request import Request
from qpage.engine.scheduler import ScheduledRequest, SchedulerOutput
from qpage.models.loader import load_model, read_arch_config
from qpage.runner.model_runner import ModelRunner
from qpage.sampling_params import SamplingParams


class RunnerHarness:
    """A model + paged cache + runner, stepped by hand (what the scheduler would do)."""

    def __init__(self, model_dir: Path, num_blocks: int = 64, max_len: int = 512,
                 dtype: torch.dtype = torch.float32, dequantize_weights: bool = False) -> None:
        self.arch = read_arch_config(model_dir)
        self.model = load_model(model_dir, self.arch, dtype, torch.device("cpu"), max_len,
                                dequantize_weights=dequantize_weights)
        self.kv = KVCacheManager(num_blocks, enable_caching=False)
        self.runner = ModelRunner(self.model, self.arch, self.kv, dtype, torch.device("cpu"))

    def request(self, rid: str, ids: list[int]) -> Request:
        return Request(rid, ids, SamplingParams(prompt_logprobs=0), 1000, set())

    def step(self, work: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
        """Compute ``n`` more tokens of each request; return its logits for those tokens
        (all prompt positions during prefill, the last one afterwards)."""
        sched = SchedulerOutput()
        for req, n in work:
            assert self.kv.allocate_slots(req, n) is not None
            done = req.num_computed_tokens + n >= req.num_tokens
            sched.scheduled.append(ScheduledRequest(req, n, done))
        out = self.runner.execute(sched)
        logits: dict[str, list[torch.Tensor]] = {}
        for rid, (_, lg) in out.prompt_logits.items():
            logits.setdefault(rid, []).append(lg)
        for i, req in enumerate(out.sample_requests):
            logits.setdefault(req.request_id, []).append(out.logits[i : i + 1])  # type: ignore[index]
        for req, n in work:
            req.num_computed_tokens += n
        return {k: torch.cat(v) for k, v in logits.items()}


def effective_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a (bias-free) linear layer's forward multiplies by, as its kernel
    holds it: the layer applied to the identity (exact: one nonzero product per output)."""
    eye = torch.eye(linear.in_features, dtype=torch.float32)
    with torch.inference_mode():
        return linear(eye).float().t()
