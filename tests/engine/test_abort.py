"""Aborting a request frees its blocks at once; the others finish unchanged."""

from __future__ import annotations

from typing import Any

from qpage import SamplingParams


def test_abort_mid_generation_frees_blocks(llm_factory: Any) -> None:
    llm = llm_factory(kv_cache_memory="128MiB", max_num_seqs=2)
    engine = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate("Keep going:", p, use_tqdm=False)[0].outputs[0].token_ids
    a = engine.add_request("Keep going:", p)
    b = engine.add_request("The longest river is " * 20, SamplingParams(max_tokens=50, ignore_eos=True))
    c = engine.add_request("Never scheduled " * 10, SamplingParams(max_tokens=50))  # still waiting
    engine.step()
    engine.step()
    used = engine.kv.usage()
    engine.abort_request(b)
    engine.abort_request(c)
    assert engine.kv.usage() < used
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == {a}
    assert done[a].outputs[0].token_ids == want
    assert engine.kv.usage() == 0.0 and not engine._requests
    engine.kv.pool.check_invariants()
