"""Checks the package's import structure from its source (no imports are executed).

- no import inside a function anywhere under ``qpage/kernels/`` (they only ever exist to
  dodge a cycle or a slow import, and the kernels have neither);
- no private name (``_x``, not dunder) of one qpage module used in another, whether imported
  (``from m import _x``) or reached as an attribute of an imported module (``m._x``);
- no import cycle among qpage's modules, counting imports inside functions too. Importing
  ``a.b.c`` also runs the ``__init__`` of ``a.b`` unless the importer lives in that package
  (which is then already initialising), so those edges count as well;
- floors: each part of the package (a subpackage, or a module at the top) stands on a floor
  of ``FLOORS``, and an import from one part into another goes strictly down. A part not
  listed there is a finding too, so a new folder is given its place.

    python scripts/check_imports.py        # prints what it finds; exit 1 if anything

Each finding names the file and line.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "qpage"
FLOORS: tuple[tuple[str, ...], ...] = (
    ("config", "version", "sampling_params"),  # plain settings, shared by everything above
    ("kernels", "parallel"),  # CPU/GPU kernels; torch.distributed groups
    ("formats",),  # checkpoint formats and the quantization scheme
    ("layers",),  # linears, attention, KV formats
    ("models",),  # model files, loading, sharding
    ("runner", "quantizers"),  # one step on the model; offline quantization
    ("engine",),  # scheduling, requests, outputs, the offline API
    ("eval", "server"),  # what drives an engine
    ("plan", "sysinfo", "inspect_model", ""),  # reports, and the package's API ("": its __init__)
    ("cli_quant", "cli_serve"),  # the command line, then its entry points
    ("cli",),
    ("__main__",),
)
"""From the ground up."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against ``mod``)."""
    if not node.level:
        return node.module or ""
    is_pkg = modules()[mod].name == "__init__.py"
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: str, tree: ast.AST, known: dict[str, Path]) -> Iterator[tuple[ast.stmt, str, list[str]]]:
    """(statement, imported qpage module, names taken from it) for each import of a qpage module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    yield node, a.name, []
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target.split(".")[0] != PACKAGE:
                continue
            names = []
            for a in node.names:
                if f"{target}.{a.name}" in known:  # a submodule
                    yield node, f"{target}.{a.name}", []
                else:
                    names.append(a.name)
            if names:
                yield node, target, names


def part(mod: str) -> str:
    """The part of the package ``mod`` belongs to: its subpackage or top module ('' for the package)."""
    return mod.split(".")[1] if "." in mod else ""


def floor_of(name: str) -> int | None:
    return next((i for i, names in enumerate(FLOORS) if name in names), None)


def function_imports(tree: ast.AST) -> Iterator[ast.stmt]:
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    yield node


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def check() -> list[str]:
    known = modules()
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        if floor_of(part(mod)) is None:
            found.append(f"{rel}: {part(mod)} has no floor in FLOORS (scripts/check_imports.py): give it one")
        if mod.startswith(f"{PACKAGE}.kernels"):
            found += [f"{rel}:{n.lineno}: import inside a function" for n in function_imports(tree)]
        aliases: dict[str, str] = {}
        for node, target, names in imports(mod, tree, known):
            if target not in known:
                found.append(f"{rel}:{node.lineno}: imports {target}, which is not a module of the package")
                continue
            here, there = part(mod), part(target)
            if here != there and floor_of(there) is not None and floor_of(here) is not None \
                    and floor_of(there) >= floor_of(here):  # type: ignore[operator]
                found.append(f"{rel}:{node.lineno}: {here or PACKAGE} (floor {floor_of(here)}) imports "
                             f"{target} from {there} (floor {floor_of(there)}): imports go down")
            if target != mod:
                graph[mod].add(target)
                parts = target.split(".")
                for i in range(1, len(parts)):  # the packages above the target run their __init__
                    parent = ".".join(parts[:i])
                    if parent in known and not (mod == parent or mod.startswith(parent + ".")):
                        graph[mod].add(parent)
            found += [f"{rel}:{node.lineno}: imports private {n} from {target}" for n in names if _private(n)]
            if isinstance(node, ast.ImportFrom) and not names:
                alias = next((a.asname or a.name for a in node.names if f"{_resolve(mod, node)}.{a.name}" == target),
                             None)
                if alias:
                    aliases[alias] = target
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == target and a.asname:
                        aliases[a.asname] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr)):
                found.append(f"{rel}:{node.lineno}: uses private {node.attr} of {aliases[node.value.id]}")
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    found = check()
    for line in found:
        print(line)
    print(f"{len(modules())} modules checked: {len(found)} finding(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
