"""The package's import structure (``scripts/check_imports.py``): no import inside a function in
``qpage/kernels``, no private name used across modules, no import cycle, imports only down the
floors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_structure() -> None:
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.check() == []


def test_checker_finds_what_it_forbids(tmp_path: Path) -> None:
    """A cycle, a private import, a private attribute, an import inside a kernel function, an
    import that goes up a floor and a part without a floor, each in a throwaway package, are
    all reported."""
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pkg = tmp_path / "qpage"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from qpage.b import _hidden\n")
    (pkg / "b.py").write_text("import qpage.a as a\n_hidden = 1\nx = a._y\n")
    (pkg / "kernels" / "k.py").write_text("def f():\n    from qpage import a\n    return a\n")
    (pkg / "config.py").write_text("from qpage.kernels import k\n")
    mod.ROOT = tmp_path
    found = "\n".join(mod.check())
    assert "imports private _hidden from qpage.b" in found
    assert "uses private _y of qpage.a" in found
    assert "k.py:2: import inside a function" in found
    assert "import cycle: qpage.a -> qpage.b" in found
    assert "config.py:1: config (floor 0) imports qpage.kernels.k from kernels (floor 1): imports go down" in found
    assert "qpage/a.py: a has no floor in FLOORS" in found
