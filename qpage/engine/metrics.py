"""Engine metrics under vLLM's Prometheus names, prefixed ``qpage:`` (docs/serving.md).

Plain Python counters, gauges and histograms: the server exposes them through
``prometheus_client`` as they are; ``LLM.get_metrics()`` returns them as a dict.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

PREFIX = "qpage:"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        """Cumulative bucket counts keyed by upper bound, as Prometheus reports them."""
        cum, out = 0, {}
        for bound, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cum += c
            out[bound] = cum
        return {"buckets": out, "sum": self.sum, "count": self.count}


HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)
COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "request_failure_total",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "spec_decode_acceptance_rate",
          "spec_decode_mean_acceptance_length", "kv_cache_blocks_held", "kv_cache_blocks_without_windows")
"""``kv_cache_blocks_held``: blocks in the running requests' tables (shared prefix blocks once per
request); ``kv_cache_blocks_without_windows``: what they would hold if sliding-window layers
kept every block (equal without such layers)."""


def spec_acceptance(drafts: float, draft_tokens: float, accepted: float) -> tuple[float, float]:
    """(acceptance rate, mean acceptance length) as vLLM defines them: accepted over drafted
    tokens, and 1 + accepted tokens per verifying step; (0, 0) before any draft."""
    rate = accepted / draft_tokens if draft_tokens else 0.0
    return rate, (1.0 + accepted / drafts if drafts else 0.0)


class EngineMetrics:
    def __init__(self) -> None:
        self.histograms = {name: Histogram() for name in HISTOGRAMS}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.gauges = dict.fromkeys(GAUGES, 0.0)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def inc(self, name: str, by: int = 1) -> None:
        self.counters[name] += by

    def update_speculation(self) -> None:
        """The speculative-decoding gauges from their counters (``spec_acceptance``)."""
        c = self.counters
        g = self.gauges
        g["spec_decode_acceptance_rate"], g["spec_decode_mean_acceptance_length"] = spec_acceptance(
            c["spec_decode_num_drafts"], c["spec_decode_num_draft_tokens"], c["spec_decode_num_accepted_tokens"])

    def snapshot(self) -> dict[str, Any]:
        """Every metric by its full Prometheus name."""
        out: dict[str, Any] = {}
        for name, v in self.gauges.items():
            out[PREFIX + name] = v
        for name, v in self.counters.items():
            out[PREFIX + name] = v
        for name, h in self.histograms.items():
            out[PREFIX + name] = h.snapshot()
        return out
