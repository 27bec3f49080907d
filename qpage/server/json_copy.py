"""A copy of a JSON value (from a client) with some of its strings rewritten, made without
recursion: a client's schema or arguments may nest past Python's recursion limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def copy_json(value: Any, text: Callable[[Any, str], str], key: Callable[[str], str] = lambda k: k) -> Any:
    """``value`` with every string ``s`` replaced by ``text(k, s)``, where ``k`` is the key (or
    list index) it sits under (None at the top), and every object key ``k`` by ``key(k)``."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, Any]] = [(value, root, 0, None)]
    while stack:
        node, parent, slot, name = stack.pop()
        copy: Any = node
        if isinstance(node, str):
            copy = text(name, node)
        elif isinstance(node, dict):
            copy = {}
            for k, v in node.items():
                k2 = key(k) if isinstance(k, str) else k
                stack.append((v, copy, k2, k))
        elif isinstance(node, list | tuple):
            copy = [None] * len(node)
            stack.extend((v, copy, i, i) for i, v in enumerate(node))
        parent[slot] = copy
    return root[0]
