"""Engine metrics under vLLM's Prometheus names, with values that move."""

from __future__ import annotations

from typing import Any

from qpage import SamplingParams
from qpage.engine.metrics import COUNTERS, GAUGES, HISTOGRAMS


def test_metrics_names_and_movement(llm_factory: Any) -> None:
    llm = llm_factory(kv_cache_memory="128MiB", max_num_seqs=2)
    engine = llm.llm_engine
    m0 = llm.get_metrics()
    for name in (*COUNTERS, *GAUGES, *HISTOGRAMS):
        assert "qpage:" + name in m0
    ids = [engine.add_request(f"Story number {i}:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
           for i in range(4)]
    engine.step()
    mid = llm.get_metrics()
    assert mid["qpage:num_requests_running"] == 2  # max_num_seqs
    assert mid["qpage:num_requests_waiting"] == 2
    assert 0 < mid["qpage:kv_cache_usage_perc"] < 1
    while engine.has_unfinished_requests():
        engine.step()
    m1 = llm.get_metrics()
    assert m1["qpage:num_requests_running"] == 0 and m1["qpage:kv_cache_usage_perc"] == 0.0
    assert m1["qpage:generation_tokens_total"] - m0["qpage:generation_tokens_total"] == 24
    n_prompt = sum(len(llm.get_tokenizer().encode(f"Story number {i}:")) for i in range(4))
    assert m1["qpage:prompt_tokens_total"] - m0["qpage:prompt_tokens_total"] == n_prompt
    assert m1["qpage:request_success_total"] - m0["qpage:request_success_total"] == len(ids)
    for name, per_req in (("time_to_first_token_seconds", 1), ("e2e_request_latency_seconds", 1),
                          ("request_queue_time_seconds", 1), ("inter_token_latency_seconds", 5)):
        h0, h1 = m0["qpage:" + name], m1["qpage:" + name]
        assert h1["count"] - h0["count"] == per_req * 4, name
        assert h1["sum"] > h0["sum"]
        assert h1["buckets"][float("inf")] == h1["count"]
    # Queued requests waited for a slot: their queue time exceeds the first ones'.
    assert m1["qpage:request_queue_time_seconds"]["sum"] > 0
