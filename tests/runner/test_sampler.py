"""Sampler on synthetic logits: filters and penalties against direct formulas."""

from __future__ import annotations

import torch

from qpage.engine.request import Request
from qpage.runner.sampler import MASKED_LOGPROB, Sampler
from qpage.sampling_params import SamplingParams


def make(params: SamplingParams, prompt: list[int] = (0,), out: list[int] = ()) -> Request:  # type: ignore[assignment]
    r = Request("r", list(prompt), params, 100, {9})
    for t in out:
        r.append_token(t)
    return r


LOGITS = torch.tensor([[3.0, 2.9, 1.0, 0.5, -1.0, -2.0, 0.0, 0.2, 0.1, 2.0]])


def draws(params: SamplingParams, n: int = 300, **kw: list[int]) -> set[int]:
    s = Sampler(0)
    return {s(LOGITS.clone(), [make(params, **kw)]).token_ids[0] for _ in range(n)}


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    assert draws(SamplingParams(temperature=0), 5) == {0}
    assert draws(SamplingParams(temperature=1.0, top_k=1), 50) == {0}


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert draws(SamplingParams(temperature=1.0, top_k=3)) == {0, 1, 9}
    # softmax mass: p0~.40, p1~.36 -> top_p=0.5 keeps {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {0, 1}
    # min_p=0.5: keep tokens with p >= 0.5 * p0 -> logits >= 3 - ln 2 = 2.31
    assert draws(SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}
    assert len(draws(SamplingParams(temperature=1.0))) >= 8


def test_penalties_follow_their_formulas() -> None:
    s = Sampler(0)
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    r = make(p, prompt=[1], out=[0, 0, 4])
    got = s._penalize(LOGITS.clone(), [r], [None])[0]
    want = LOGITS[0].clone()
    for t in (0, 1, 4):  # prompt and output tokens: repetition penalty
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[0] -= 0.25 * 2 + 0.5  # output tokens only: frequency x count + presence
    want[4] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(got, want)


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    s = Sampler(0)
    logits = torch.zeros(1, 10)
    logits[0, 9] = 10.0  # eos is by far the most likely
    logits[0, 8] = 9.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    assert s(logits, [make(p)]).token_ids[0] not in (8, 9)
    assert s(logits, [make(p, out=[1, 2])]).token_ids[0] == 9


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [Sampler(0)(LOGITS.clone(), [make(p)]).token_ids[0] for _ in range(1)]
    big = LOGITS.repeat(3, 1)
    mixed = Sampler(99)(big, [make(SamplingParams(temperature=1.0)), make(p),
                               make(SamplingParams(temperature=0.5, seed=7))]).token_ids[1]
    assert mixed == alone[0]


def test_draw_frequencies_follow_the_distribution() -> None:
    s = Sampler(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    want = torch.softmax(logits[0], -1)
    r = make(SamplingParams(temperature=1.0))
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[s(logits.clone(), [r]).token_ids[0]] += 1
    # 4000 draws: each frequency within 0.03 of its probability (> 4 standard deviations).
    torch.testing.assert_close(counts / 4000, want, atol=0.03, rtol=0)
    assert counts[3] == 0


def test_processed_logprobs_are_the_scores_greedy_picks_from() -> None:
    """Raw logprobs describe the model (a penalised token still leads there); processed ones
    the row after penalties and min_tokens masking, where the greedy pick is rank 1 and a
    forbidden token reports the finite floor."""
    p = SamplingParams(temperature=0, repetition_penalty=2.0, min_tokens=3, logprobs=3)
    r = make(p, prompt=[0])  # token 0 (the raw top) is penalised; 9 (eos) is banned by min_tokens
    raw = Sampler(0)(LOGITS.clone(), [r])
    done = Sampler(0, processed_logprobs=True)(LOGITS.clone(), [r])
    assert raw.token_ids == done.token_ids == [1]
    assert raw.top_logprobs[0][1].rank == 2 and done.top_logprobs[0][1].rank == 1  # type: ignore[index]
    torch.testing.assert_close(torch.tensor(raw.logprobs[0]), torch.log_softmax(LOGITS[0], -1)[1])
    want = LOGITS[0].clone()
    want[0], want[9] = want[0] / 2, float("-inf")
    torch.testing.assert_close(torch.tensor(done.logprobs[0]), torch.log_softmax(want, -1)[1])
    assert set(done.top_logprobs[0]) == {1, 0, 2}  # type: ignore[arg-type]
    full = Sampler(0, processed_logprobs=True)(LOGITS.clone(), [make(SamplingParams(
        temperature=0, min_tokens=3, logprobs=10))])
    assert full.top_logprobs[0][9].logprob == MASKED_LOGPROB  # type: ignore[index]


def test_verify_keeps_tokens_up_to_the_first_that_is_not_the_draft() -> None:
    greedy = SamplingParams(temperature=0, logprobs=0)
    rows = torch.full((7, 10), -5.0)
    for i, t in enumerate([3, 4, 1, 6, 2, 5, 8]):  # each row's argmax
        rows[i, t] = 5.0
    a, b, c = make(greedy), make(greedy), make(greedy)
    reqs, res, failed = Sampler(0).verify(rows, [a, b, c], [[3, 9], [6, 2], []])
    # a's rows 0-2: 3 == draft 3, then 4 != draft 9: kept 3, 4. b's rows 3-5: 6 == 6, 2 == 2, then 5.
    assert reqs == [a, a, b, b, b, c]
    assert res.token_ids == [3, 4, 6, 2, 5, 8] and not failed
    assert all(lp is not None for lp in res.logprobs)
    # Penalties see the drafts before a row: a repetition penalty on row 1 applies to draft 0.
    pen = make(SamplingParams(temperature=0, repetition_penalty=100.0))
    two = torch.zeros(2, 10)
    two[:, 7] = 3.0
    two[:, 2] = 2.0
    assert Sampler(0).verify(two, [pen], [[7]])[1].token_ids == [7, 2]


def test_verify_rewinds_a_seeded_stream_to_the_rows_it_kept() -> None:
    p = SamplingParams(temperature=1.0, seed=5)
    flat = torch.zeros(3, 10)
    plain = make(p)
    s = Sampler(0)
    first = s(flat[:1], [plain]).token_ids[0]
    after_one = plain.rng.random()  # type: ignore[union-attr]
    spec = make(p)
    wrong = (first + 1) % 10
    res = s.verify(flat, [spec], [[wrong, wrong]])[1]
    assert res.token_ids == [first]  # the first row's draw differs from the draft: one token kept
    assert spec.rng.random() == after_one  # type: ignore[union-attr]  # as if one row had drawn
