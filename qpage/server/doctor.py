"""``qpage doctor``: explain a slow server from its own metrics.

Two samples of the metrics some seconds apart are compared along the usual checklist:
1. KV cache full, preemptions rising (requests recompute their prompts);
2. waiting queue growing (arrivals outpace the batch);
3. prefill chunks starving decodes (inter-token latency spikes while prompts are prefilled);
4. quantized kernels on the slow fallback path, or attention on the plain-torch path on a GPU.
Each finding says what was seen and what to change. The same code serves
``GET /health?verbose=1`` (in-process samples) and ``qpage doctor --url`` (scraped).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qpage.engine.metrics import COUNTERS, PREFIX, spec_acceptance


@dataclass(frozen=True)
class Finding:
    check: str
    status: str
    """'warn' (a problem and its fix) or 'ok'."""
    evidence: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative ``buckets`` (upper bound -> count)."""
    items = sorted(buckets.items())
    total = items[-1][1] if items else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in items:
        if count >= rank:
            if bound == float("inf"):
                return lo_bound
            width = count - lo_count
            frac = (rank - lo_count) / width if width > 0 else 1.0
            return lo_bound + (bound - lo_bound) * frac
        lo_bound, lo_count = bound, count
    return lo_bound


def _hist_delta(before: dict[str, Any], after: dict[str, Any], name: str) -> dict[float, float]:
    a, b = after[PREFIX + name]["buckets"], before[PREFIX + name]["buckets"]
    return {k: a[k] - b.get(k, 0.0) for k in a}


def diagnose(before: dict[str, Any], after: dict[str, Any], seconds: float, info: dict[str, Any]) -> list[Finding]:
    """Findings from two metric snapshots ``seconds`` apart; ``info`` holds the engine config
    (``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_dtype``, ``device``), the attention
    backend and the quantized-linear counts by kernel path."""
    checks = (_kv_pressure, _queue_growth, _prefill_stalls, _kernel_paths, _speculation)
    found = [f for check in checks if (f := check(before, after, seconds, info)) is not None]
    if not any(f.status == "warn" for f in found):
        running, waiting = after[PREFIX + "num_requests_running"], after[PREFIX + "num_requests_waiting"]
        kv = 100.0 * after[PREFIX + "kv_cache_usage_perc"]
        found.append(Finding("summary", "ok", f"no problem found over {seconds:.0f}s: running {running:.0f}, "
                                              f"waiting {waiting:.0f}, KV cache {kv:.1f}%"))
    return found


Snap = dict[str, Any]


def _kv_pressure(before: Snap, after: Snap, seconds: float, info: Snap) -> Finding | None:
    pre = after[PREFIX + "num_preemptions_total"] - before[PREFIX + "num_preemptions_total"]
    kv = after[PREFIX + "kv_cache_usage_perc"]
    if pre <= 0 and kv < 0.95:
        return None
    smaller = _smaller_kv_dtype(str(info.get("kv_cache_dtype", "auto")))
    return Finding(
        "kv_cache_full", "warn",
        f"KV cache {100 * kv:.1f}% used and {pre:.0f} preemptions in {seconds:.0f}s: preempted requests "
        "lose their blocks and recompute their prompts",
        f"give the cache more room: raise --kv-cache-memory, {smaller}serve an INT4/FP8 checkpoint to free "
        "weight memory for KV (`qpage plan` shows the capacity), or lower --max-num-seqs "
        f"(now {info.get('max_num_seqs', '?')}) so fewer requests share the cache",
    )


def _speculation(before: Snap, after: Snap, seconds: float, info: Snap) -> Finding | None:
    """Speculative decoding's acceptance over the window: a warning when most drafts are rejected."""
    def delta(name: str) -> float:
        return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)

    drafts, tokens, accepted = delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens"), \
        delta("spec_decode_num_accepted_tokens")
    if tokens <= 0:
        return None
    rate, length = spec_acceptance(drafts, tokens, accepted)
    evidence = (f"speculative decoding verified {tokens:.0f} draft tokens in {seconds:.0f}s: acceptance "
                f"{100 * rate:.0f}%, mean accepted length {length:.2f} tokens per step")
    if rate >= 0.2:
        return Finding("speculative_decoding", "ok", evidence)
    return Finding("speculative_decoding", "warn", evidence + " (most drafts are thrown away)",
                   "this traffic does not repeat its input: lower num_speculative_tokens in --speculative-config, "
                   "or serve without it (docs/speculative.md says when n-gram drafts pay)")


def _smaller_kv_dtype(current: str) -> str:
    """A suggestion of a KV cache dtype with fewer bytes per token than ``current`` ("" if none)."""
    if current.startswith("int4"):
        return ""
    if current.startswith(("fp8", "int8", "k8v4")):
        return "--kv-cache-dtype int4 (about 0.28x the bytes of fp16 per token; more quality loss: docs/kv-cache.md), "
    return ("--kv-cache-dtype int8 (about half the bytes of fp16 per token, near-lossless) or int4 (about "
            "0.28x; more loss: docs/kv-cache.md), ")


def _queue_growth(before: Snap, after: Snap, seconds: float, info: Snap) -> Finding | None:
    w0, w1 = before[PREFIX + "num_requests_waiting"], after[PREFIX + "num_requests_waiting"]
    if w1 <= 0 or w1 <= w0:
        return None
    running = after[PREFIX + "num_requests_running"]
    max_seqs = info.get("max_num_seqs")
    kv = after[PREFIX + "kv_cache_usage_perc"]
    q = quantile(_hist_delta(before, after, "request_queue_time_seconds"), 0.5)
    queue_s = f", median queue time {q:.2f}s" if q is not None else ""
    if max_seqs is not None and running >= max_seqs and kv < 0.9:
        fix = (f"the batch is capped by --max-num-seqs={max_seqs} while the KV cache is {100 * kv:.0f}% used: "
               "raise --max-num-seqs")
    elif kv >= 0.9:
        fix = "the KV cache is the limit: see kv_cache_full"
    else:
        fix = ("the server is compute-bound: run a smaller or quantized model, add a replica, or set "
               "--max-waiting so excess load gets 503 (retry) instead of waiting")
    return Finding("waiting_queue_growing", "warn",
                   f"waiting requests rose from {w0:.0f} to {w1:.0f} in {seconds:.0f}s with {running:.0f} "
                   f"running{queue_s}", fix)


def _prefill_stalls(before: Snap, after: Snap, seconds: float, info: Snap) -> Finding | None:
    prompt = after[PREFIX + "prompt_tokens_total"] - before[PREFIX + "prompt_tokens_total"]
    itl = _hist_delta(before, after, "inter_token_latency_seconds")
    p50, p90 = quantile(itl, 0.5), quantile(itl, 0.9)
    if prompt <= 0 or p50 is None or p90 is None or p90 < 3 * p50 or p90 < 0.05:
        return None
    return Finding(
        "prefill_starves_decode", "warn",
        f"inter-token latency p50 {1000 * p50:.0f} ms but p90 {1000 * p90:.0f} ms while {prompt:.0f} prompt "
        f"tokens were prefilled in {seconds:.0f}s: decode steps wait behind long prefill chunks",
        f"lower --max-num-batched-tokens (now {info.get('max_num_batched_tokens', '?')}) so prefills are cut "
        "into smaller chunks that interleave with decodes",
    )


def _kernel_paths(before: Snap, after: Snap, seconds: float, info: Snap) -> Finding | None:
    slow = int(info.get("quantized_linears", {}).get("dequantized-fallback", 0))
    backend, device = info.get("attention_backend"), info.get("device")
    problems, fixes = [], []
    if slow:
        problems.append(f"{slow} quantized linear layers run the dequantized fallback (dense weights, "
                        "no fused kernel)")
        fixes.append("install Triton for this torch build (`pip install triton`) and restart")
    if device == "cuda" and backend == "torch":
        problems.append("attention runs on the plain-torch path on a GPU")
        fixes.append("install Triton, or drop --attention-backend torch")
    if device == "cpu" and backend == "cpu-blas":
        problems.append("the fp32 CPU path runs without qpage's C kernels (decode attention and the cache "
                        "write, norms, activations): slower at batch 1, about 1.4x with the fp32 cache and 2x "
                        "with an FP8 one")
        fixes.append("install a C compiler (gcc) and restart; the start-up log's 'native CPU kernels "
                     "unavailable' line says why they did not build")
    if not problems:
        return None
    return Finding("kernel_fallback", "warn", "; ".join(problems), "; ".join(fixes))


def parse_prometheus(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(snapshot shaped like ``EngineMetrics.snapshot()``, info) from ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    snap: dict[str, Any] = {}
    info: dict[str, Any] = {"quantized_linears": {}}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        if fam.type == "histogram":
            buckets: dict[float, float] = {}
            total = 0.0
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    buckets[float(s.labels["le"])] = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
            snap[fam.name] = {"buckets": buckets, "sum": total, "count": buckets.get(float("inf"), 0.0)}
            continue
        for s in fam.samples:
            if s.name == PREFIX + "quantized_linear_layers":
                info["quantized_linears"][s.labels["path"]] = s.value
            elif s.name == PREFIX + "attention_backend_info":
                info["attention_backend"], info["device"] = s.labels["backend"], s.labels["device"]
            elif s.name == PREFIX + "engine_config_info":
                info.update({k: _num(v) for k, v in s.labels.items() if k != "model_name"})
            elif fam.type == "counter" and s.name.endswith("_total"):
                # Prometheus names a counter's sample NAME_total; the engine's own names
                # sometimes already end in _total (num_preemptions_total).
                snap[s.name if s.name.removeprefix(PREFIX) in COUNTERS else s.name.removesuffix("_total")] = s.value
            elif fam.type == "gauge":
                snap[s.name] = s.value
    return snap, info


def _num(v: str) -> Any:
    try:
        return int(v)
    except ValueError:
        return v


def report(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"[{f.status.upper():4}] {f.check}: {f.evidence}")
        if f.fix:
            lines.append(f"       fix: {f.fix}")
    return "\n".join(lines)
