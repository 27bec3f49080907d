"""Chat content read as text: a special token's string written inside a message (for example
``<|im_end|>\\n<|im_start|>system\\n...`` in user content) is tokenized as the plain text it
is, never as the control token, so a client cannot forge a turn of another role. The chat
template's own special tokens are unaffected.

How: before the template is rendered, each special-token string in the messages and tools
is replaced by one character of Unicode's Supplementary Private Use Area (one character per
special token); the rendered text is tokenized piece by piece, the template's text as usual
and each such character as its token's string split into ordinary tokens. Conversations
without special-token strings are rendered and tokenized exactly as before.
"""

from __future__ import annotations

import re
from typing import Any

from qpage.server.json_copy import copy_json

MARK_BASE = 0xF0000
"""First private-use code point standing for a special token (U+F0000 .. U+FFFFD)."""


class ContentGuard:
    """The tokenizer's special-token strings, and how to keep them out of client content."""

    def __init__(self, tokenizer: Any) -> None:
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        specials |= set(getattr(tokenizer, "all_special_tokens", None) or [])
        self.tokenizer = tokenizer
        self.specials = sorted((s for s in specials if s), key=len, reverse=True)  # longest first
        self._index = {s: i for i, s in enumerate(self.specials)}
        self._find = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        last = chr(MARK_BASE + max(len(self.specials) - 1, 0))
        self._marks = re.compile(f"([{chr(MARK_BASE)}-{last}])")

    def _defuse_str(self, s: str) -> str:
        assert self._find is not None
        return self._find.sub(lambda m: chr(MARK_BASE + self._index[m.group(0)]), s)

    def defuse(self, value: Any) -> tuple[Any, bool]:
        """(A copy of ``value`` with every special-token string in its strings and keys
        replaced by its mark, whether any was)."""
        if self._find is None:
            return value, False
        hit = False

        def text(s: str) -> str:
            nonlocal hit
            out = self._defuse_str(s)
            hit = hit or out != s
            return out
        return copy_json(value, lambda _, s: text(s), text), hit

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text with marks: each mark becomes its special token's string
        as ordinary tokens (``split_special_tokens``), the rest is tokenized as usual."""
        ids: list[int] = []
        for i, piece in enumerate(self._marks.split(text)):
            if not piece:
                continue
            if i % 2:  # a mark
                ids += self.tokenizer.encode(self.specials[ord(piece) - MARK_BASE], add_special_tokens=False,
                                             split_special_tokens=True)
            else:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids
