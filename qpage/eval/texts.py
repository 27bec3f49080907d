"""Evaluation and calibration texts by name: a file path, or a text that ships with Python.

``python-docs`` is CPython's own reference text (``pydoc_data.topics``: the language
reference's topics, about 460,000 characters of technical English with code), joined in
sorted topic order so every run reads the same text. It is far from wikitext's
encyclopaedia prose, so it serves as a held-out domain for quantizers calibrated on
wikitext, with nothing to download.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN = ("python-docs",)


def read_text(source: str | Path) -> str:
    """The text of a built-in name or of a UTF-8 file."""
    if str(source) == "python-docs":
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return "\n\n".join(topics[k] for k in sorted(topics))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{source}: no such text file (or a built-in text: {', '.join(BUILTIN)})")
    return path.read_text(encoding="utf-8")


def text_label(source: str | Path) -> str:
    """A short name for tables: the built-in name or the file's name."""
    return str(source) if str(source) in BUILTIN else Path(source).name
