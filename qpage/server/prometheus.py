"""The engine's metrics in Prometheus' text format (``GET /metrics``).

The engine keeps plain counters, gauges and histograms (``engine.metrics``); a snapshot
taken on the engine thread is turned into metric families here, so a scrape always sees
one consistent step boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from qpage.engine.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX

HELP = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Share of KV-cache blocks in use (1 = full).",
    "kv_cache_blocks_held": "KV blocks in the running requests' tables (sliding-window layers keep their window).",
    "kv_cache_blocks_without_windows": "KV blocks those requests would hold if every layer kept every token.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions_total": "Requests preempted (KV blocks freed, recomputed later).",
    "prompt_tokens_total": "Prompt tokens received.",
    "generation_tokens_total": "Tokens generated.",
    "request_success_total": "Requests finished (stop or length).",
    "request_failure_total": "Requests that failed inside the engine (their client got the error).",
    "spec_decode_num_drafts": "Speculative decoding: request steps that verified draft tokens.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
    "spec_decode_acceptance_rate": "Speculative decoding: accepted / draft tokens since start.",
    "spec_decode_mean_acceptance_length": "Speculative decoding: tokens per verifying step (1 + accepted / drafts).",
    "time_to_first_token_seconds": "Arrival to first generated token.",
    "inter_token_latency_seconds": "Time between two generated tokens of one sequence.",
    "e2e_request_latency_seconds": "Arrival to finish.",
    "request_queue_time_seconds": "Arrival to first scheduling.",
}


class _SnapshotCollector:
    def __init__(self, snap: dict[str, Any], kernels: dict[str, Any], model: str, config: dict[str, Any]) -> None:
        self.snap, self.kernels, self.model, self.config = snap, kernels, model, config

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        for name in GAUGES:
            g = GaugeMetricFamily(PREFIX + name, HELP[name], labels=labels)
            g.add_metric([self.model], float(self.snap[PREFIX + name]))
            yield g
        for name in COUNTERS:
            c = CounterMetricFamily(PREFIX + name, HELP[name], labels=labels)
            c.add_metric([self.model], float(self.snap[PREFIX + name]))
            yield c
        for name in HISTOGRAMS:
            h = self.snap[PREFIX + name]
            buckets = [("+Inf" if math.isinf(b) else floatToGoString(b), float(v)) for b, v in h["buckets"].items()]
            fam = HistogramMetricFamily(PREFIX + name, HELP[name], labels=labels)
            fam.add_metric([self.model], buckets, float(h["sum"]))
            yield fam
        k = GaugeMetricFamily(PREFIX + "quantized_linear_layers",
                              "Quantized linear layers by kernel path (dequantized-fallback is the slow path).",
                              labels=["model_name", "path"])
        for path, count in sorted(self.kernels["quantized_linears"].items()):
            k.add_metric([self.model, path], float(count))
        yield k
        a = GaugeMetricFamily(PREFIX + "attention_backend_info", "The attention backend in use (value 1).",
                              labels=["model_name", "backend", "device"])
        a.add_metric([self.model, self.kernels["attention_backend"], self.kernels["device"]], 1.0)
        yield a
        names = sorted(self.config)
        c = GaugeMetricFamily(PREFIX + "engine_config_info", "Engine settings (value 1).",
                              labels=["model_name", *names])
        c.add_metric([self.model, *(str(self.config[n]) for n in names)], 1.0)
        yield c


def render(snap: dict[str, Any], kernels: dict[str, Any], model: str, config: dict[str, Any]) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_SnapshotCollector(snap, kernels, model, config))  # type: ignore[arg-type]
    return generate_latest(reg)
