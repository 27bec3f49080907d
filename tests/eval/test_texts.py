"""Calibration and evaluation texts: the built-in texts, and windows mixed from several
texts (``perplexity.mixed_windows``), on a character-level stand-in tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from qpage.cli import _parser
from qpage.eval.perplexity import mixed_windows, token_windows
from qpage.eval.texts import SOURCE_MODULES, read_text, text_label


class Chars:
    """A tokenizer with one token per character (what the window functions need of one)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_python_source_is_the_listed_modules() -> None:
    text = read_text("python-source")
    assert "class ArgumentParser" in text and "def dataclass(" in text and "def dedent(" in text
    assert text.index("class ArgumentParser") < text.index("def dataclass(")  # SOURCE_MODULES' order
    assert len(SOURCE_MODULES) == len(set(SOURCE_MODULES))
    assert read_text("python-source") == text
    assert text_label("python-source") == "python-source"


def test_mixed_windows_alternate_sources(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a" * 40)
    b.write_text("b" * 12)  # three windows of 4 only
    got = mixed_windows(Chars(), [a, b], 4, 7)
    letters = "".join(chr(w[0]) for w in got)
    assert letters == "ababab" + "a"  # b runs out after three; a makes up the count
    assert all(len(w) == 4 for w in got)
    assert mixed_windows(Chars(), [a], 4, 5) == token_windows(Chars(), a, 4, 5)  # one source: as before
    with pytest.raises(ValueError, match="no calibration text"):
        mixed_windows(Chars(), [], 4, 2)


def test_cli_takes_several_calibration_texts() -> None:
    args = _parser().parse_args(["quantize", "default", "out", "--calib", "valid.txt", "python-source",
                                 "--scheme", "int4-imatrix"])
    assert args.calib == ["valid.txt", "python-source"]
