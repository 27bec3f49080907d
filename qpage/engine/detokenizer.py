"""Incremental detokenization and stop strings.

Text is produced a token at a time by decoding a short window of ids twice: the window up
to the last emitted point and the window with the new token. The difference is the new
text; it is held back while it ends in U+FFFD (a multi-byte character whose bytes have
not all arrived: Chinese, emoji). The window starts in the prompt's tail so tokenizers that
drop a leading space at the start of a decode (SentencePiece) still get it right.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 6  # prompt tokens of left context


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool,
        stop: list[str], include_stop: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; return the matched stop string if the text now contains one
        (only when ``check_stop``: stop strings wait for ``min_tokens``, as in vLLM)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        old_len = len(self.text)
        self.text += delta
        return self._check_stop(old_len) if check_stop else None

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        # A stop string may straddle the old and the new text.
        lo = max(old_len - self._max_stop + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped = True
        return s

    def flush(self) -> None:
        """At the end, emit a held-back incomplete character as U+FFFD, as a full decode does."""
        if self.stopped or self.read == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before):
            self.text += after[len(before) :]
        self.prefix = self.read = len(self.ids)

    def stable_text(self, finished: bool) -> str:
        """Text safe to stream: holds back a tail that could still become a stop string."""
        if finished or self._max_stop <= 1:
            return self.text
        return self.text[: max(len(self.text) - self._max_stop + 1, 0)]
