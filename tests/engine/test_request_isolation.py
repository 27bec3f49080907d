"""A request's failure is that request's alone: when sampling or output processing fails
for one request inside a step, that request ends with ``finish_reason`` 'error' and the
reason, and the others in the same batch finish exactly as they would have alone."""

from __future__ import annotations

from typing import Any

import pytest

from qpage import SamplingParams
from qpage.engine.request import Request
from qpage.runner.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON_K = 4242  # the top_k that marks the request the faulty sampler fails on


class FaultySampler(Sampler):
    """Fails any batch that holds a request with top_k == POISON_K."""

    def __call__(self, logits: Any, reqs: list[Request], uniforms: Any = None, masks: Any = None) -> Any:
        if any(r.params.top_k == POISON_K for r in reqs):
            raise RuntimeError("injected sampling fault")
        return super().__call__(logits, reqs, uniforms, masks)


def run_all(engine: Any) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_fault_fails_only_its_request(llm: Any, monkeypatch: pytest.MonkeyPatch, seeded: bool) -> None:
    engine = llm.llm_engine
    innocent = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True) if seeded else GREEDY
    alone = llm.generate("The capital of France is", innocent, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(engine.runner, "sampler", FaultySampler(engine.config.seed))
    good = engine.add_request("The capital of France is", innocent)
    bad = engine.add_request("Tell me a story", SamplingParams(temperature=1.0, top_k=POISON_K, n=2, max_tokens=12))
    done = run_all(engine)
    assert done[good].error is None and done[good].outputs[0].token_ids == alone
    assert done[bad].error is not None and "injected sampling fault" in done[bad].error
    assert [c.finish_reason for c in done[bad].outputs] == ["error", "error"]
    assert engine.kv.usage() == 0.0 and engine.get_metrics()["qpage:request_failure_total"] >= 1


def test_output_fault_fails_only_its_request(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.llm_engine
    alone = llm.generate("Water boils at", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    real = engine.outputs.add_token

    def add_token(req: Request, res: Any, i: int, now: float) -> bool:
        if req.parent_id == "victim" and req.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(req, res, i, now)

    monkeypatch.setattr(engine.outputs, "add_token", add_token)
    good = engine.add_request("Water boils at", GREEDY)
    engine.add_request("Once upon a time", GREEDY, request_id="victim")
    done = run_all(engine)
    assert done[good].outputs[0].token_ids == alone
    assert "injected detokenizer fault" in done["victim"].error
    assert done["victim"].outputs[0].finish_reason == "error" and done[good].error is None
    assert engine.kv.usage() == 0.0


def test_seed_uses_all_64_bits() -> None:
    """Every bit of a 64-bit seed counts: seeds equal modulo 2**32 draw different numbers."""

    def first_draws(seed: int) -> list[float]:
        r = Request("r", [1], SamplingParams(seed=seed), 4, set())
        return [r.rng.random() for _ in range(4)]  # type: ignore[union-attr]

    assert first_draws(5) == first_draws(5)
    assert first_draws(5) != first_draws(5 + 2**32)
    assert first_draws(2**63 - 1) != first_draws(2**31 - 1)
    assert first_draws(-5) != first_draws(5)
