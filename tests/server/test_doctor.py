"""The doctor's checklist on engine metric snapshots, and the /metrics round trip."""

from __future__ import annotations

import copy
from typing import Any

from qpage.engine.metrics import PREFIX, EngineMetrics
from qpage.server.doctor import diagnose, parse_prometheus, quantile
from qpage.server.prometheus import render

INFO: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "kv_cache_dtype": "auto",
                        "attention_backend": "cpu-native", "device": "cpu", "quantized_linears": {}}


def snapshots() -> tuple[EngineMetrics, dict[str, Any]]:
    m = EngineMetrics()
    for _ in range(50):
        m.observe("inter_token_latency_seconds", 0.03)
    return m, copy.deepcopy(m.snapshot())


def checks(findings: list[Any]) -> dict[str, Any]:
    return {f.check: f for f in findings}


def test_quiet_server_is_ok() -> None:
    m, before = snapshots()
    found = checks(diagnose(before, m.snapshot(), 10, INFO))
    assert list(found) == ["summary"] and found["summary"].status == "ok"


def test_kv_full_and_preemptions() -> None:
    m, before = snapshots()
    m.gauges["kv_cache_usage_perc"] = 0.99
    m.inc("num_preemptions_total", 4)
    f = checks(diagnose(before, m.snapshot(), 10, INFO))["kv_cache_full"]
    assert f.status == "warn" and "4 preemptions" in f.evidence
    assert "--kv-cache-memory" in f.fix and "--kv-cache-dtype int8" in f.fix
    # A smaller KV dtype is suggested while there is one.
    for current, suggested in (("fp8", "--kv-cache-dtype int4"), ("int8_per_token_head", "--kv-cache-dtype int4"),
                               ("k8v4", "--kv-cache-dtype int4"),
                               ("int4", None)):
        fix = checks(diagnose(before, m.snapshot(), 10, {**INFO, "kv_cache_dtype": current}))["kv_cache_full"].fix
        assert (suggested in fix) if suggested else ("--kv-cache-dtype" not in fix), (current, fix)


def test_waiting_queue_growing_at_max_num_seqs() -> None:
    m, before = snapshots()
    m.gauges["num_requests_running"] = 8
    m.gauges["num_requests_waiting"] = 12
    m.gauges["kv_cache_usage_perc"] = 0.3
    f = checks(diagnose(before, m.snapshot(), 10, INFO))["waiting_queue_growing"]
    assert "0 to 12" in f.evidence and "raise --max-num-seqs" in f.fix


def test_prefill_starving_decodes() -> None:
    m, before = snapshots()
    m.inc("prompt_tokens_total", 8000)
    for v in [0.03] * 40 + [0.9] * 10:
        m.observe("inter_token_latency_seconds", v)
    f = checks(diagnose(before, m.snapshot(), 10, INFO))["prefill_starves_decode"]
    assert "--max-num-batched-tokens (now 1024)" in f.fix
    # The same latencies without prefill traffic are not blamed on prefill.
    m2, before2 = snapshots()
    for v in [0.03] * 40 + [0.9] * 10:
        m2.observe("inter_token_latency_seconds", v)
    assert "prefill_starves_decode" not in checks(diagnose(before2, m2.snapshot(), 10, INFO))


def test_kernel_fallback() -> None:
    m, before = snapshots()
    info = {**INFO, "device": "cuda", "attention_backend": "torch",
            "quantized_linears": {"dequantized-fallback": 210}}
    f = checks(diagnose(before, m.snapshot(), 10, info))["kernel_fallback"]
    assert "210 quantized linear layers" in f.evidence and "Triton" in f.fix
    f = checks(diagnose(before, m.snapshot(), 10, {**INFO, "attention_backend": "cpu-blas"}))["kernel_fallback"]
    assert "without qpage's C kernels" in f.evidence and "C compiler" in f.fix
    # The C kernels read and write FP8 caches too: the BLAS path there is a fallback as well.
    fp8 = {**INFO, "attention_backend": "cpu-blas", "kv_cache_dtype": "fp8"}
    assert "C compiler" in checks(diagnose(before, m.snapshot(), 10, fp8))["kernel_fallback"].fix
    native = {**fp8, "attention_backend": "cpu-native"}
    assert "kernel_fallback" not in checks(diagnose(before, m.snapshot(), 10, native))


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert quantile(buckets, 0.5) == 0.1
    assert abs(quantile(buckets, 0.75) - 0.15) < 1e-12  # type: ignore[operator]
    assert quantile({float("inf"): 0.0}, 0.5) is None


def test_metrics_text_round_trip() -> None:
    m, _ = snapshots()
    m.inc("num_preemptions_total", 3)
    m.inc("prefix_cache_hits", 7)
    m.gauges["kv_cache_usage_perc"] = 0.25
    snap = m.snapshot()
    kernels = {"attention_backend": "triton", "device": "cuda", "quantized_linears": {"triton-fused": 210}}
    text = render(snap, kernels, "m", {"max_num_seqs": 8, "kv_cache_dtype": "fp8"}).decode()
    parsed, info = parse_prometheus(text)
    for key, value in snap.items():
        if isinstance(value, dict):
            assert parsed[key]["buckets"] == {k: float(v) for k, v in value["buckets"].items()}, key
        else:
            assert parsed[key] == value, key
    assert info["quantized_linears"] == {"triton-fused": 210.0}
    assert info["max_num_seqs"] == 8 and info["kv_cache_dtype"] == "fp8" and info["attention_backend"] == "triton"
    assert PREFIX + "num_preemptions_total" in parsed


def test_speculation_acceptance() -> None:
    m, before = snapshots()
    m.inc("spec_decode_num_drafts", 100)
    m.inc("spec_decode_num_draft_tokens", 400)
    m.inc("spec_decode_num_accepted_tokens", 40)
    f = checks(diagnose(before, m.snapshot(), 10, INFO))["speculative_decoding"]
    assert f.status == "warn" and "acceptance 10%" in f.evidence and "1.40 tokens" in f.evidence
    assert "num_speculative_tokens" in f.fix
    m.inc("spec_decode_num_drafts", 100)
    m.inc("spec_decode_num_draft_tokens", 400)
    m.inc("spec_decode_num_accepted_tokens", 360)  # 50% over the window
    m.update_speculation()
    f = checks(diagnose(before, m.snapshot(), 10, INFO))["speculative_decoding"]
    assert f.status == "ok" and "acceptance 50%" in f.evidence
    assert m.gauges["spec_decode_acceptance_rate"] == 0.5 and m.gauges["spec_decode_mean_acceptance_length"] == 3.0
    assert "speculative_decoding" not in checks(diagnose(before, before, 10, INFO))
