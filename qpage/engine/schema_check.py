"""What a constraint may say for its output to be guaranteed: the JSON-schema keywords and
combinations the grammar library (XGrammar) honours, and regexes it reads as written.

The library drops some keywords silently (``uniqueItems``, ``contains``, ``not``, a second
``allOf`` entry, ``multipleOf`` on numbers, ``minLength`` next to ``pattern``) and emits
values the schema rejects (an ``enum`` of strings under ``"type": "integer"``). Rather than
return such output with ``finish_reason: "stop"``, ``check_schema`` refuses the schema with
a ValueError naming the keyword and where it sits (a JSON pointer). Keywords JSON Schema
itself treats as annotations (``title``, ``format`` values it does not know, vendor ``x-``
keys) are let through: they constrain nothing.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

UNSUPPORTED = {
    "uniqueItems": "items are not compared with each other",
    "contains": "no item is forced to match it",
    "minContains": "no item is forced to match `contains`",
    "maxContains": "no item is forced to match `contains`",
    "not": "negation is not expressible",
    "if": "conditions are not expressible",
    "then": "conditions are not expressible",
    "else": "conditions are not expressible",
    "dependentRequired": "conditional requirements are not expressible",
    "dependentSchemas": "conditional requirements are not expressible",
    "dependencies": "conditional requirements are not expressible",
    "$dynamicRef": "dynamic references are not resolved",
    "$recursiveRef": "dynamic references are not resolved",
    "additionalItems": "it is ignored; use prefixItems with items",
}
"""JSON-schema validation keywords the library ignores, with why (the text of the 400)."""
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
RANGES = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
          ("minimum", "maximum"))
MAX_REPEAT = 1000
"""Largest ``{n}`` / ``{n,m}`` count in a regex, a grammar or a schema's pattern (each repeat
is compiled out, so compile time grows with it)."""
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_ANCHOR = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[\^$]")


def _pointer(path: tuple[str, ...]) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


def _fail(path: tuple[str, ...], what: str) -> ValueError:
    return ValueError(f"the JSON schema at {_pointer(path)} {what}")


def check_repeats(text: str, where: str) -> None:
    """ValueError if a repetition count in ``text`` is over ``MAX_REPEAT``."""
    for m in _REPEAT.finditer(text):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > MAX_REPEAT:
            raise ValueError(f"the repetition count {n} in {m.group(0)!r} in {where} is over {MAX_REPEAT}; use + "
                             "or * (and maxLength in a schema) instead")


def check_regex(rx: str, where: str = "the regex") -> None:
    """ValueError if ``rx`` has ``^`` or ``$`` anywhere but its two ends (the library drops
    such anchors: the match is always whole, so ``a^b`` would match ``ab``), or a repetition
    count past ``MAX_REPEAT``."""
    check_repeats(rx, where)
    for m in _ANCHOR.finditer(rx):
        tok, at = m.group(0), m.start()
        if (tok == "^" and at != 0) or (tok == "$" and at != len(rx) - 1):
            raise ValueError(f"{where} has the anchor {tok!r} at position {at}; anchors may only open or close "
                             "it (the whole output is matched); remove it")


def _subschemas(node: dict[str, Any], path: tuple[str, ...]) -> list[tuple[Any, tuple[str, ...]]]:
    """The schemas directly inside ``node`` with their paths; ValueError for a container of the wrong shape."""
    out: list[tuple[Any, tuple[str, ...]]] = []
    for key in SUBSCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise _fail((*path, key), f"is a {type(node[key]).__name__}; `{key}` must be an object of schemas")
            out += [(v, (*path, key, k)) for k, v in node[key].items()]
    for key in SUBSCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list):
                raise _fail((*path, key), f"is a {type(node[key]).__name__}; `{key}` must be a list of schemas")
            out += [(v, (*path, key, str(i))) for i, v in enumerate(node[key])]
    for key in SUBSCHEMA_ONE:
        if key in node:
            if isinstance(node[key], list):
                raise _fail((*path, key), f"is a list; `{key}` must be one schema (for a tuple use prefixItems)")
            out.append((node[key], (*path, key)))
    return out


def _resolve(root: Any, node: Any) -> Any:
    """``node``, or what its local ``$ref`` ("#/$defs/Cat") points at in ``root`` (a few hops
    of references to references); None where a reference leads nowhere."""
    for _ in range(8):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#")):
            return node
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
    return node


def _types(node: Any) -> set[str] | None:
    """The JSON types a branch allows, where its ``type``, ``const`` or ``enum`` says (else None)."""
    def of(v: Any) -> str:
        return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
                dict: "object", type(None): "null"}[type(v)]
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {of(node["const"])}
    if isinstance(node.get("enum"), list):
        return {of(v) for v in node["enum"]}
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if types is not None and "number" in types:
        types.add("integer")  # an integer is also a number
    return types


def _discriminator(branches: list[Any]) -> bool:
    """Every branch an object that requires one same property with its own distinct ``const``."""
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    common = set.intersection(*(set(b.get("required") or []) for b in branches))
    for name in common:
        consts = [b["properties"].get(name) for b in branches]
        if all(isinstance(c, dict) and "const" in c for c in consts):
            values = [repr(c["const"]) for c in consts]
            if len(set(values)) == len(values):
                return True
    return False


def _check_one_of(branches: list[Any], path: tuple[str, ...], root: Any) -> None:
    """oneOf is generated as anyOf, which is exact only when no value can match two branches:
    branches of disjoint types, or objects told apart by a required ``const`` property (as in
    pydantic's discriminated unions, whose branches are references)."""
    branches = [_resolve(root, b) for b in branches]
    kinds = [_types(b) for b in branches]
    if all(k is not None for k in kinds):
        seen: set[str] = set()
        for k in kinds:
            if k & seen:  # type: ignore[operator]
                break
            seen |= k  # type: ignore[operator]
        else:
            return
    if _discriminator(branches):
        return
    raise _fail(path, "has branches one value may match twice; `oneOf` can only be enforced when the branches "
                      "have distinct types or a required property with a distinct `const` in each (or use anyOf)")


def _check_values(node: dict[str, Any], path: tuple[str, ...]) -> None:
    """``enum``/``const`` values are emitted as they are, so each must pass the node's other keywords."""
    key = "const" if "const" in node else "enum" if "enum" in node else None
    if key is None or "$ref" in repr(node):
        return
    values = [node["const"]] if key == "const" else node["enum"]
    if not isinstance(values, list) or not values:
        raise _fail((*path, key), "allows no value; give at least one")
    if "pattern" in node:  # checking the values would run the client's regex here
        raise _fail(path, f"combines `{key}` with `pattern`, and only `{key}` would be enforced; drop `pattern`")
    rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
    validator = jsonschema.Draft202012Validator(rest)
    for v in values:
        err = jsonschema.exceptions.best_match(validator.iter_errors(v))
        if err is not None:
            raise _fail((*path, key), f"lists {v!r}, which the rest of its schema rejects ({err.message}); "
                                      "remove the value or the conflicting keyword")


def _check_node(node: dict[str, Any], path: tuple[str, ...], root: Any) -> None:
    """One schema object's own keywords (its subschemas are checked by the walk)."""
    for key, why in UNSUPPORTED.items():
        if key in node:
            raise _fail(path, f"uses `{key}`, which structured outputs cannot enforce ({why}); remove it")
    for key in ("unevaluatedProperties", "unevaluatedItems"):
        if key in node and node[key] is not False:
            raise _fail(path, f"uses `{key}` with a schema, which structured outputs cannot enforce; remove it")
    for key in ("anyOf", "oneOf"):
        if key in node and not node[key]:
            raise _fail((*path, key), "is empty, so no value matches it; give at least one schema")
    if len(node.get("allOf") or []) > 1:
        raise _fail((*path, "allOf"), "has several schemas, which structured outputs cannot combine; merge them "
                                      "into one")
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1:
        _check_one_of(node["oneOf"], (*path, "oneOf"), root)
    for fixed in ("pattern", "format"):
        if fixed in node and ("minLength" in node or "maxLength" in node):
            fix = ("put the length into the pattern (e.g. ^[a-z]{2,8}$)" if fixed == "pattern" else
                   "drop minLength/maxLength, or give a `pattern` instead of `format`")
            raise _fail(path, f"combines `{fixed}` with minLength/maxLength, and only `{fixed}` would be "
                              f"enforced; {fix}")
    if "multipleOf" in node and node.get("type") != "integer":
        raise _fail(path, "uses `multipleOf` on a non-integer, which structured outputs cannot enforce; remove it")
    for lo, hi in RANGES:
        if isinstance(node.get(lo), int | float) and isinstance(node.get(hi), int | float) and node[lo] > node[hi]:
            raise _fail(path, f"has {lo} {node[lo]} over {hi} {node[hi]}, so no value matches it")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        names = props if isinstance(props, dict) else {}
        missing = [r for r in required if r not in names]
        if missing:
            raise _fail((*path, "required"), f"names {', '.join(map(repr, missing))}, which `properties` does not "
                                             "define (undefined properties are never generated); define it")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], f"the `pattern` at {_pointer(path)}")
    for rx in node.get("patternProperties") or {}:
        check_regex(rx, f"the patternProperties key at {_pointer(path)}")
    _check_values(node, path)


def check_schema(schema: Any) -> None:
    """ValueError naming the keyword and its JSON pointer if ``schema`` says anything the
    grammar would not enforce, or that no value can meet. Walked without recursion (depth is
    bounded by the caller)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool) or not isinstance(node, dict):
            continue
        _check_node(node, path, schema)
        stack.extend(_subschemas(node, path))
