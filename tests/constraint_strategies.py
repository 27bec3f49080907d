"""Hypothesis strategies for structured-output constraints, shared by the engine's and the
server's fuzz tests: random JSON schemas built from the keywords the docs list as enforced
(with, now and then, one the grammar cannot enforce), and random regexes as small trees that
print both as a Python regex and as an EBNF grammar (so a grammar's output is checked with
``re.fullmatch``)."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import strategies as st

from qpage.engine.schema_check import UNSUPPORTED

NAMES = st.sampled_from(["a", "id", "name", "x y", "n2", "tag"])
FORMATS = ["date", "email", "ipv4", "uuid", "date-time", "time"]
PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][a-z]*-[0-9]{2}$", r"^(yes|no)$", r"^\d{3}$"]
SMALL = st.integers(0, 4)


def _numeric(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    bound = st.integers(-50, 50) if kind == "integer" else st.one_of(st.integers(-50, 50), st.floats(-50, 50).map(
        lambda f: round(f, 2)))
    keys = st.fixed_dictionaries({}, optional={"minimum": bound, "maximum": bound, "exclusiveMinimum": bound,
                                               "exclusiveMaximum": bound})
    extra = st.fixed_dictionaries({}, optional={"multipleOf": st.integers(2, 5)}) if kind == "integer" else st.just({})
    return st.tuples(keys, extra).map(lambda t: {"type": kind, **t[0], **t[1]})


LEAVES = st.one_of(
    _numeric("integer"), _numeric("number"),
    st.fixed_dictionaries({"type": st.just("string")}, optional={"minLength": SMALL, "maxLength": st.integers(0, 12)}),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"], "maxLength": 5}]),
    st.lists(st.one_of(st.integers(-9, 9), st.text(max_size=4), st.booleans(), st.none()), min_size=1, max_size=4,
             unique_by=repr).map(lambda v: {"enum": v}),
    st.one_of(st.integers(), st.text(max_size=5), st.just({"k": [1, None]})).map(lambda v: {"const": v}),
)


def _containers(child: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def obj(props: dict[str, Any], draw_req: list[bool], extra: dict[str, Any]) -> dict[str, Any]:
        req = [k for k, r in zip(props, draw_req, strict=False) if r]
        return {"type": "object", "properties": props, "required": req, **extra}
    objects = st.builds(obj, st.dictionaries(NAMES, child, max_size=3), st.lists(st.booleans(), max_size=3),
                        st.fixed_dictionaries({}, optional={"additionalProperties": st.just(False)}))
    arrays = st.builds(lambda items, lim: {"type": "array", "items": items, **lim}, child,
                       st.fixed_dictionaries({}, optional={"minItems": st.integers(0, 2), "maxItems": SMALL}))
    tuples = st.lists(child, min_size=1, max_size=2).map(lambda c: {"type": "array", "prefixItems": c, "items": False})
    unions = st.lists(child, min_size=1, max_size=3).map(lambda c: {"anyOf": c})
    one_of = st.just({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "null"}]})
    return st.one_of(objects, arrays, tuples, unions, one_of)


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=6)
NUMERIC_KEYWORDS = ("uniqueItems", "minContains", "maxContains")
WITH_UNSUPPORTED = st.tuples(SCHEMAS, st.sampled_from(sorted(UNSUPPORTED))).map(
    lambda t: {**t[0], t[1]: 1 if t[1] in NUMERIC_KEYWORDS else {"type": "integer"}})
SOMETIMES_UNSUPPORTED = st.one_of(SCHEMAS, SCHEMAS, SCHEMAS, WITH_UNSUPPORTED)

# Regexes as a small tree, printed both as a Python regex and as an EBNF grammar.
ATOMS = st.sampled_from([("lit", "ab"), ("lit", "x"), ("lit", "-"), ("cls", "a-z"), ("cls", "0-9"), ("cls", "A-C")])


def _patterns(child: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.tuples(st.just("seq"), st.lists(child, min_size=2, max_size=3)),
                     st.tuples(st.just("alt"), st.lists(child, min_size=2, max_size=3)),
                     st.tuples(st.just("rep"), child, st.sampled_from(["?", "+", "*", "{1,3}", "{2}"])))


TREES = st.recursive(ATOMS, _patterns, max_leaves=6)


SYNTAX = {  # literal, group, sequence separator, alternation separator
    "regex": (re.escape, "(?:{})", "", "|"),
    "ebnf": (json.dumps, "({})", " ", " | "),
}


def render(t: Any, syntax: str) -> str:
    """The pattern tree ``t`` as a Python regex or as the right side of an EBNF rule."""
    literal, group, seq, alt = SYNTAX[syntax]
    kind = t[0]
    if kind == "lit":
        return literal(t[1])
    if kind == "cls":
        return f"[{t[1]}]"
    if kind in ("seq", "alt"):
        return (seq if kind == "seq" else alt).join(group.format(render(c, syntax)) for c in t[1])
    return group.format(render(t[1], syntax)) + t[2]
