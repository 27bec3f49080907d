"""Constraints the grammar would not enforce are refused by name, before any token: each
JSON-schema keyword or combination the grammar library drops or gets wrong, regex anchors
it ignores, and constraints that match no text at all."""

from __future__ import annotations

from typing import Any

import pytest

from qpage.engine import structured
from qpage.engine.structured import GrammarCompiler
from qpage.sampling_params import StructuredOutputsParams

INT = {"type": "integer"}


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 49152, {2})


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, "#/properties/a/anyOf is empty"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, "#/required names 'b'"),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uses `uniqueItems`"),
    ({"type": "array", "items": INT, "contains": {"const": 7}}, "uses `contains`"),
    ({"type": "integer", "enum": ["a", "b"]}, "#/enum lists 'a'"),
    ({"type": "integer", "minimum": 5, "const": 3}, "#/const lists 3"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 5}, "combines `pattern` with minLength"),
    ({"type": "string", "format": "email", "maxLength": 8}, "combines `format` with minLength"),
    ({"allOf": [INT, {"minimum": 5}]}, "#/allOf has several schemas"),
    ({"not": {"type": "string"}}, "uses `not`"),
    ({"if": INT, "then": {"minimum": 3}}, "uses `if`"),
    ({"oneOf": [INT, {"type": "number"}]}, "#/oneOf has branches one value may match twice"),
    ({"type": "number", "multipleOf": 0.5}, "`multipleOf` on a non-integer"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 over maxLength 2"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "a^b"}}}, "anchor '^' at position 1"),
    ({"type": "array", "items": [INT, INT]}, "for a tuple use prefixItems"),
    ({"type": "object", "$defs": [1, 2]}, "#/$defs is a list"),
    ({"type": "object", "properties": {"a": {"enum": ["x"], "pattern": "^x$"}}}, "combines `enum` with `pattern`"),
])
def test_schema_the_grammar_would_not_enforce_is_refused_by_keyword(
        grammars: GrammarCompiler, schema: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("$", r"\$").replace("^", r"\^").replace("(", r"\(")):
        grammars.compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "enum": [1, 2]},
    {"oneOf": [INT, {"type": "string"}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"const": "b"}, "x": INT}, "required": ["k"]}]},
    {"allOf": [{"type": "integer", "minimum": 3}]},
    {"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": INT},  # pydantic's
                       "required": ["kind", "lives"]},  # discriminated union: a oneOf of references
               "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}},
     "type": "object", "required": ["pet"], "properties": {"pet": {
         "discriminator": {"propertyName": "kind"}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}},
    {"type": "object", "properties": {"a": INT}, "required": ["a"], "title": "T", "x-vendor": {"not": 1}},
    {"type": "string", "pattern": "^[a-z]{2,8}$"},
    {"type": "integer", "multipleOf": 3},
])
def test_schemas_the_grammar_enforces_compile(grammars: GrammarCompiler, schema: dict[str, Any]) -> None:
    grammars.compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("so, words", [
    (dict(regex="a^b"), "anchor '^' at position 1"),
    (dict(regex="a$b"), "anchor '$' at position 1"),
    (dict(regex=r"[^\s\S]"), "matches no text"),
    (dict(grammar='root ::= a\na ::= a "x"'), "matches no text"),
    (dict(grammar='root ::= s\ns ::= s s | "a" | "b" | "c"'), "too ambiguous to follow; rewrite"),
    (dict(choice=["\U00044a48"]), "matches no text"),  # a character no token of the vocabulary produces
    (dict(choice=["x\u00e2\U00044a48"]), "only characters that no token of this model's vocabulary produces"),
])
def test_regex_anchors_and_constraints_matching_nothing_or_too_costly_are_refused(
        grammars: GrammarCompiler, so: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("$", r"\$").replace("^", r"\^")):
        grammars.compile(StructuredOutputsParams(**so))


@pytest.mark.parametrize("grammar", [
    'root ::= s\ns ::= "a" s | "b" s | "c"',  # the right-recursive form the refusal suggests
    'root ::= s\ns ::= s "+" s | [a-z]+',  # ambiguous, but its masks stay cheap
    'root ::= e\ne ::= e "+" t | t\nt ::= t "*" f | f\nf ::= [0-9]+ | "(" e ")"',  # left-recursive
])
def test_grammars_whose_masks_stay_cheap_compile(grammars: GrammarCompiler, grammar: str) -> None:
    grammars.compile(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("rx", ["^ab$", "[$^]x", r"\^a\$", "a|b"])
def test_anchors_at_the_ends_or_escaped_are_fine(grammars: GrammarCompiler, rx: str) -> None:
    grammars.compile(StructuredOutputsParams(regex=rx))


def test_a_refused_constraint_is_remembered(grammars: GrammarCompiler, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client repeating a refused grammar gets the same error without another compile."""
    so = StructuredOutputsParams(grammar='root ::= s\ns ::= s s | "a"')
    with pytest.raises(ValueError, match="too ambiguous") as first:
        grammars.compile(so)
    calls = []
    monkeypatch.setattr(structured, "compile_source", lambda *a: calls.append(a))
    with pytest.raises(ValueError) as again:
        grammars.compile(so)
    assert str(again.value) == str(first.value) and not calls
