"""Fuzzing structured outputs on the real model (hypothesis, bounded and derandomized):
random JSON schemas built from the keywords the docs list as enforced (with, now and then, one
the grammar cannot enforce), random regexes and the same patterns as EBNF grammars. Every
constraint either is refused with a ValueError naming what it cannot honour, or every output
that ends with ``finish_reason == "stop"`` is valid: ``jsonschema`` (with its format
checker) for schemas, Python's ``re.fullmatch`` for regexes and grammars."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qpage import SamplingParams, StructuredOutputsParams
from qpage.engine.schema_check import UNSUPPORTED
from tests.constraint_strategies import SOMETIMES_UNSUPPORTED, TREES, render

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Reply with a short JSON value."}]


def _run(llm: Any, sos: list[StructuredOutputsParams], seed: int) -> list[Any]:
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=64, structured_outputs=so)
              for i, so in enumerate(sos)]
    return [o.outputs[0] for o in llm.chat([PROMPT] * len(sos), params, use_tqdm=False)]


FUZZ = settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(schemas=st.lists(SOMETIMES_UNSUPPORTED, min_size=6, max_size=6), seed=st.integers(0, 1000))
def test_fuzzed_schemas_refused_by_name_or_every_stop_output_valid(llm: Any, schemas: list[Any], seed: int) -> None:
    accepted = []
    for schema in schemas:
        so = StructuredOutputsParams(json=schema)
        try:
            llm.llm_engine.grammars.compile(so)
        except ValueError as e:
            assert re.search(r"`|JSON schema at|invalid json", str(e)), (schema, str(e))
            assert not any(k in schema for k in UNSUPPORTED) or any(f"`{k}`" in str(e) for k in schema), str(e)
            continue
        assert not any(k in schema for k in UNSUPPORTED), f"{schema} compiled, but uses an unenforced keyword"
        accepted.append((schema, so))
    checker = jsonschema.FormatChecker()
    for (schema, _), c in zip(accepted, _run(llm, [so for _, so in accepted], seed), strict=True):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema, format_checker=checker)


@FUZZ
@given(trees=st.lists(TREES, min_size=4, max_size=4), seed=st.integers(0, 1000))
def test_fuzzed_regexes_and_grammars_every_stop_output_matches(llm: Any, trees: list[Any], seed: int) -> None:
    sos = [StructuredOutputsParams(regex=render(t, "regex")) for t in trees]
    sos += [StructuredOutputsParams(grammar=f"root ::= {render(t, 'ebnf')}") for t in trees]
    outs = _run(llm, sos, seed)
    for t, c in zip(trees + trees, outs, strict=True):
        if c.finish_reason == "stop":
            assert re.fullmatch(render(t, "regex"), c.text), (render(t, "regex"), c.text)
