"""Speculative decoding (n-gram drafts and draft models): outputs are exactly those without it.

Greedy requests give the same tokens and logprobs (the CPU kernels are batch-invariant, so a
draft row's logits are the bits a one-row decode gives), on the default model packed and
dequantized, for a batch of mixed prompts and under a KV budget that forces preemption;
seeded sampled requests give the same tokens too (the sampler rewinds their streams), and so
do constrained requests (their grammar checks and masks the drafts); unseeded
sampling keeps the model's distribution (a chi-square fit to transformers' exact distribution,
on a tiny model)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qpage import LLM, SamplingParams, StructuredOutputsParams
from qpage.config import SpeculativeConfig
from qpage.engine import scheduler as scheduler_module
from qpage.engine.draft_model import catch_up_pays
from qpage.engine.request import Request
from qpage.engine.speculative import NgramDrafter, StepCost, ngram_lookup

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"model": "self:int4", "num_speculative_tokens": 4}


@pytest.fixture
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request drafts as many tokens as it may, whatever the batch (the step-cost policy,
    tested on its own below, drafts little in large batches): these tests are about exactness."""
    monkeypatch.setattr(StepCost, "row_share", lambda self, rows: 0.0)
    monkeypatch.setattr(StepCost, "step_seconds", lambda self, rows: None)  # a draft model's steps: free
CODE = inspect.getsource(scheduler_module)[:1200]


def test_ngram_lookup_takes_the_latest_longest_match() -> None:
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    assert ngram_lookup(t, 1, 3, 2) == [7, 8]  # "2 3" last seen before "7 8" (n=2; no 3-gram "5 2 3")
    assert ngram_lookup(t, 3, 3, 2) == []
    assert ngram_lookup(np.array([4, 4, 4], dtype=np.int64), 1, 2, 5) == [4]  # n=2: only [4 4] at 0, then 4
    assert ngram_lookup(np.array([6], dtype=np.int64), 1, 4, 3) == []


def test_step_cost_fit_and_draft_lengths() -> None:
    cost = StepCost()
    assert cost.row_share(1) == StepCost.PRIOR_ROW_SHARE
    assert abs(cost.row_share(16) - 1.6 / 2.5) < 1e-9  # the prior: a row costs 10% of a one-row step
    for rows, ms in ((1, 10.0), (2, 10.5), (3, 11.0), (5, 12.0), (16, 26.0), (20, 30.0)):
        cost.observe(rows, ms / 1000)
    assert abs(cost.row_share(1) - 0.05) < 1e-9  # counts 1-4 seen: 0.5 ms a row, 10 ms a step
    # counts 16 and 20 span too little alone: the line through 5, 16 and 20 (1.22 ms a row, 25.5 ms at 16)
    assert abs(cost.row_share(16) - 0.76256) < 1e-4
    cost.observe(3, 0.0092)  # noise at one count moves the slope, it does not make rows free
    assert 0.03 < cost.row_share(1) < 0.05
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=8), max_model_len=100)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=50), 50, set())
    drafter.record(req, 10, 9)  # rate (9 + 0.25) / (10 + 0.5) = 0.881
    assert drafter.draft_length(req, 1 / 11) == 8  # 0.881**8 = 0.36 > 0.09: all it may
    assert drafter.draft_length(req, 0.7) == 2  # 0.881, 0.776 > 0.7 > 0.684
    for _ in range(30):  # its drafts stop being right, one a step: it stops drafting
        drafter.record(req, 1, 0)
    assert drafter.draft_length(req, 1 / 11) == 0
    req.max_tokens = 3
    drafter.record(req, 50, 50)
    assert drafter.draft_length(req, 0.0) == 2  # room for 3 tokens: 2 drafts and the model's own
    # A request that stopped drafting tries again once its failures have faded.
    bad = Request("b", [1, 2, 3], SamplingParams(max_tokens=50), 50, set())
    for _ in range(30):
        drafter.record(bad, 1, 0)
    tries = next(i for i in range(500) if drafter.draft_length(bad, 1 / 11) > 0)
    assert 20 < tries < 100


def test_config_names_its_errors() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 3}') == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=3, prompt_lookup_max=3)
    assert SpeculativeConfig.parse({"model": "self:int4"}).method == "draft_model"
    assert SpeculativeConfig.parse({"model": "self:INT4"}).self_format == "q4_0"
    for bad, words in (({"num_speculative_token": 4}, "unknown key(s) num_speculative_token"),
                       ({"method": "draft_model"}, "needs 'model'"), ("{4}", "not valid JSON"),
                       ({"model": "self:q3_k"}, "a self draft takes one of self:int4"),
                       ({"model": "d.gguf", "prompt_lookup_max": 3}, "belong to method 'ngram'"),
                       ({"method": "ngram", "model": "d.gguf"}, "takes no 'model'"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "1 <= min <= max"),
                       ({"method": "eagle"}, "method='eagle' is not supported")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.parse(bad)


def test_a_catch_up_is_paid_for_only_by_enough_kept_drafts() -> None:
    # rate 0.9, k 4: 3.10 tokens kept a step for 4 x 0.35 = 1.4 tokens of cost; 100 tokens left
    # take 24.4 steps, saving 1.70 x 24.4 = 41.4 tokens' time: a catch-up of 40 tokens' time pays.
    assert catch_up_pays(0.9, 4, 0.35, 100, 0.01, 0.40)
    assert not catch_up_pays(0.9, 4, 0.35, 100, 0.01, 0.45)
    assert not catch_up_pays(0.9, 4, 0.35, 10, 0.01, 0.05)  # too few tokens left to win it back
    assert not catch_up_pays(0.5, 2, 0.6, 1000, 0.01, 0.0)  # drafts that do not pay for their rows


def test_step_cost_judges_counts_it_has_not_seen() -> None:
    """A batch whose steps always carry drafts is seen at more rows than it has requests: the
    slope comes from the counts drafts would reach, or the nearest ones."""
    for span in (5, 1):  # the counts drafts would reach (16 to 80 rows), or the nearest ones
        cost = StepCost(span=span)
        for rows, ms in ((55, 120.0), (60, 125.0), (75, 140.0), (80, 145.0)):
            cost.observe(rows, ms / 1000)
        assert abs(cost.step_seconds(16) - 0.081) < 1e-9  # 1 ms a row over 65 ms, extrapolated to 16
        assert abs(cost.row_share(16) - 16 / 81) < 1e-9
    # Counts 12 to 16 alone would give a flat, noisy slope (free rows); with count 5 the line
    # spans half the rows and a row costs what it does.
    cost = StepCost(span=5)
    for rows, ms in ((5, 30.0), (12, 38.2), (13, 42.1), (16, 38.3)):
        cost.observe(rows, ms / 1000)
    assert cost.row_share(16) > 0.2


def test_draft_model_needs_the_targets_vocabulary(peaked_tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="its vocabulary has 24 tokens, the target's 49152"):
        LLM(log_stats=False, speculative_config={"model": str(peaked_tiny_llama)})
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        LLM(log_stats=False, tensor_parallel_size=2, speculative_config=DRAFT)


def _mixed(tokenizer: Any) -> tuple[list[str], list[SamplingParams]]:
    """Eight prompts: some the output quotes (drafts accepted), ordinary ones, a stop string,
    a repetition penalty with logprobs, min_tokens, n=2."""
    g = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    prompts = [f"Copy this code:\n{CODE}\n", f"Repeat after me: {CODE[:400]}", "Count from 1 to 30: 1, 2, 3,",
               "What is a cat?", f"Summarise this code:\n{CODE[:600]}", "Name three rivers.",
               "Say 'a b a b a b' ten times:", f"Copy:\n{CODE[200:800]}"]
    params = [g, g, SamplingParams(temperature=0, max_tokens=48, stop=[", 20"]), g,
              SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=30), g,
              SamplingParams(temperature=0, max_tokens=32, n=2, ignore_eos=True)]
    return prompts, params


def _tokens(outs: list[Any]) -> list[Any]:
    return [[(tuple(c.token_ids), c.text, c.finish_reason,
              None if c.logprobs is None else [{k: v.logprob for k, v in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
@pytest.mark.parametrize("dequantize", [False, True], ids=["packed", "dequantized"])
@pytest.mark.usefixtures("always_draft")
def test_greedy_outputs_equal_without_speculation(dequantize: bool, spec: dict[str, Any], tokenizer: Any) -> None:
    """Roomy, and tight enough to preempt (a draft model's K/V shares the blocks: half as many)."""
    prompts, params = _mixed(tokenizer)
    base = {"log_stats": False, "dequantize_weights": dequantize, "max_model_len": 512}
    want = _tokens(LLM(**base).generate(prompts, params, use_tqdm=False))
    for kv in ("1GiB", "24MiB" if spec is NGRAM else "48MiB"):
        llm = LLM(**base, kv_cache_memory=kv, speculative_config=spec)
        got = _tokens(llm.generate(prompts, params, use_tqdm=False))
        m = llm.get_metrics()
        for i, (w, o) in enumerate(zip(want, got, strict=True)):
            assert o == w, f"kv {kv}: prompt {i} differs with speculation"
        accepted, drafted = m["qpage:spec_decode_num_accepted_tokens"], m["qpage:spec_decode_num_draft_tokens"]
        assert 20 < accepted < drafted, m
        if spec is DRAFT:  # a 4-bit copy mostly agrees with its model: its own cache is right
            assert accepted > 0.4 * drafted, m
        if kv != "1GiB":
            assert m["qpage:num_preemptions_total"] > 0


RECORD = {"id": 4172, "name": "Ada Lovelace", "born": 1815, "notes": ["first program", "Analytical Engine"]}
RECORD_SCHEMA = {"type": "object", "required": ["id", "name", "born", "notes"], "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "born": {"type": "integer"},
    "notes": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
@pytest.mark.usefixtures("always_draft")
def test_constrained_requests_speculate_exactly(spec: dict[str, Any]) -> None:
    """A constrained request's drafts are cut at the first token its grammar refuses, and each
    draft row is masked by the grammar's state after the drafts before it: greedy and seeded
    sampled outputs equal those without speculation, and drafts are kept."""
    so = StructuredOutputsParams
    prompts = [f"Return this JSON object exactly, nothing else: {json.dumps(RECORD)}\n",
               f"Copy this record as JSON: {json.dumps(RECORD)}", "Write 'ab' many times:", "Describe a cat."]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=RECORD_SCHEMA)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=64, structured_outputs=so(json=RECORD_SCHEMA)),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=so(regex=r"(ab ){2,12}(done)?")),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=so(choice=["a small cat", "a cat"]))]
    want = _tokens(LLM(log_stats=False, max_model_len=256).generate(prompts * 2, params * 2, use_tqdm=False))
    json.loads(want[0][0][1])  # the constraint held
    for kv in ("1GiB", "12MiB" if spec is NGRAM else "24MiB"):  # roomy, and tight enough to preempt
        llm = LLM(log_stats=False, max_model_len=256, kv_cache_memory=kv, speculative_config=spec)
        assert _tokens(llm.generate(prompts * 2, params * 2, use_tqdm=False)) == want, kv
        m = llm.get_metrics()
        assert 10 < m["qpage:spec_decode_num_accepted_tokens"] < m["qpage:spec_decode_num_draft_tokens"], m
        assert (m["qpage:num_preemptions_total"] > 0) == (kv != "1GiB"), m


@pytest.mark.slow
@pytest.mark.usefixtures("always_draft")
def test_seeded_sampling_equals_without_speculation(llm_factory: Any) -> None:
    prompts = [f"Copy this code:\n{CODE}\n", "Tell me a story about a dog."]
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True) for s in (1, 2)]
    want = _tokens(llm_factory(model=None, log_stats=False).generate(prompts, params, use_tqdm=False))
    llm = LLM(log_stats=False, speculative_config=NGRAM)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.get_metrics()["qpage:spec_decode_num_accepted_tokens"] > 0


VOCAB, SAMPLES = 24, 20_000


@pytest.fixture(scope="module")
def peaked_tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 1-layer random Llama over 24 tokens whose next-token distributions are peaked but far
    from one-hot (a scaled head), so drafts are accepted and rejected often."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    out = tmp_path_factory.mktemp("peaked-llama")
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).is_file():
            (out / name).write_bytes((default_model_dir / name).read_bytes())
    return out


def _prompt(llm: LLM) -> list[int]:
    """A prompt made of the model's own greedy output, so that looked-up drafts are often, not
    always, what the model samples."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    return [5, *llm.generate([{"prompt_token_ids": [5]}], greedy, use_tqdm=False)[0].outputs[0].token_ids]


def _samples(model: Path, spec: dict[str, Any] | None) -> tuple[list[int], np.ndarray, dict[str, Any]]:
    """(prompt, the 2nd and 3rd tokens of SAMPLES unseeded temperature-1 completions, metrics)."""
    llm = LLM(model=str(model), log_stats=False, max_num_seqs=1024, max_num_batched_tokens=8192,
              speculative_config=spec)
    prompt = _prompt(llm)
    p = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=1000, detokenize=False)
    pairs = [c.token_ids[1:] for _ in range(SAMPLES // 1000)
             for c in llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs]
    return prompt, np.array(pairs), llm.get_metrics()


def _exact(model: Path, prompt: list[int]) -> list[np.ndarray]:
    """transformers' distributions of the 2nd and 3rd generated tokens, the 1st and 2nd summed
    out (every one of VOCAB**2 continuations scored)."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = m(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = m(torch.tensor([[*prompt, a] for a in range(VOCAB)])).logits[:, -1].softmax(-1)
        p3 = m(torch.tensor([[*prompt, a, b] for a in range(VOCAB) for b in range(VOCAB)])).logits[:, -1]
        p3 = p3.softmax(-1).view(VOCAB, VOCAB, VOCAB)
    return [(p1[:, None] * p2).sum(0).numpy(), (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1)).numpy()]


def _chi2_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square goodness-of-fit test (tokens expected fewer than 5 times
    left out, as the test's approximation needs)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.usefixtures("always_draft")
def test_rejection_sampling_keeps_the_distribution(peaked_tiny_llama: Path) -> None:
    """With and without speculation (n-gram drafts, and a greedy draft model: the model itself
    at 8 bits), the 2nd and 3rd tokens' frequencies fit the model's own distribution (from
    transformers) at the 1% level, and drafts were both kept and rejected."""
    for spec in (None, {**NGRAM, "prompt_lookup_min": 1}, {"model": "self:q8_0", "num_speculative_tokens": 3}):
        prompt, samples, m = _samples(peaked_tiny_llama, spec)
        if spec is not None:
            accepted, drafted = m["qpage:spec_decode_num_accepted_tokens"], m["qpage:spec_decode_num_draft_tokens"]
            assert 0.1 * drafted < accepted < 0.9 * drafted, m
        for pos, probs in enumerate(_exact(peaked_tiny_llama, prompt)):
            p_value = _chi2_fit(np.bincount(samples[:, pos], minlength=VOCAB), probs)
            assert p_value > 0.01, f"speculation {spec}: token {pos + 2}: chi-square p = {p_value:.2g}"


@pytest.mark.slow
@pytest.mark.usefixtures("always_draft")
def test_two_ranks_speculate_exactly(default_model_dir: Path) -> None:
    """Tensor parallelism: the driver drafts and verifies, every rank runs the draft rows."""
    prompts = [f"Copy this code:\n{CODE[:600]}\n", "Count from 1 to 30: 1, 2, 3,"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(model=str(default_model_dir), kv_cache_memory="64MiB", tensor_parallel_size=2, log_stats=False,
                  speculative_config=spec)
        try:
            outs[spec is None] = _tokens(llm.generate(prompts, sp, use_tqdm=False))
            if spec is not None:
                assert llm.get_metrics()["qpage:spec_decode_num_accepted_tokens"] > 10
        finally:
            llm.shutdown()
    assert outs[False] == outs[True]
