"""Evaluation and calibration texts by name: a file path, or a text that ships with Python.

``python-docs`` is CPython's own reference text (``pydoc_data.topics``: the language
reference's topics, about 460,000 characters of technical English with code), joined in
sorted topic order so every run reads the same text. It is far from wikitext's
encyclopaedia prose, so it serves as a held-out domain for quantizers calibrated on
wikitext, with nothing to download.

``python-source`` is source code: the standard library modules in ``SOURCE_MODULES``, read
from the running Python (so it follows its version), for calibration mixes that should
include code. It is not ``python-docs``'s text, but it is the same language's domain.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

BUILTIN = ("python-docs", "python-source")
SOURCE_MODULES = ("argparse", "dataclasses", "enum", "functools", "textwrap", "pathlib", "subprocess",
                  "typing", "json/decoder", "logging/__init__", "collections/__init__", "shutil", "tempfile",
                  "string", "heapq", "bisect", "fractions", "statistics", "csv", "configparser")
"""Standard library modules (paths under the library folder, without ``.py``) in
``python-source``, in this order."""


def read_text(source: str | Path) -> str:
    """The text of a built-in name or of a UTF-8 file."""
    if str(source) == "python-docs":
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return "\n\n".join(topics[k] for k in sorted(topics))
    if str(source) == "python-source":
        lib = Path(sysconfig.get_paths()["stdlib"])
        return "\n\n".join((lib / f"{m}.py").read_text(encoding="utf-8") for m in SOURCE_MODULES)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{source}: no such text file (or a built-in text: {', '.join(BUILTIN)})")
    return path.read_text(encoding="utf-8")


def text_label(source: str | Path) -> str:
    """A short name for tables: the built-in name or the file's name."""
    return str(source) if str(source) in BUILTIN else Path(source).name
