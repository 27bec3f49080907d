"""SamplingParams with vLLM's field names, defaults and meaning, and the structured-output
constraint a request may carry (``StructuredOutputsParams``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

_GREEDY_EPS = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds are 64-bit signed integers, as in vLLM's server."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class StructuredOutputsParams:
    """Constrain a completion to a JSON schema, a regex, one of several strings, an EBNF
    grammar or any JSON object (vLLM's names). Exactly one of them is given; the engine
    compiles it into a token mask (``engine.structured``)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict or its JSON text): the output is a JSON value valid against it."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF, as llama.cpp and XGrammar read it) whose ``root`` rule the output matches."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    disable_any_whitespace: bool = False
    """JSON output without free whitespace between tokens (shorter, but less natural to the model)."""

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, (bool, type(None))):
            raise ValueError("json_object must be true or false")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be true or false")
        given = [k for k in self.KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(self.KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"json is not valid JSON text ({e}); give a JSON schema") from None
            except RecursionError:
                raise ValueError("json nests too deeply to read; give a flatter JSON schema") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"json must be a JSON schema (an object), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in self.KINDS if getattr(self, k) is not None and getattr(self, k) is not False)


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name for the same constraint (``SamplingParams(guided_decoding=...)``)."""


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM-compatible)."""

    n: int = 1
    """Number of completions to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of a token in the generated text."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in prompt or output (divides positive, multiplies negative logits)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all (as does any k >= the vocabulary)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same output whatever else is batched."""
    stop: str | list[str] | None = None
    """Strings that end the completion; excluded from the text unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the completion."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None runs to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the completion."""
    logprobs: int | None = None
    """Return the log-probabilities of this many top tokens (plus the sampled one) per step."""
    prompt_logprobs: int | None = None
    """Return the log-probabilities of the prompt tokens (plus this many top tokens)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    detokenize: bool = True
    """Produce text (False returns token ids only)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar."""
    guided_decoding: StructuredOutputsParams | None = None
    """vLLM's older spelling of ``structured_outputs``; give one or the other."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self._stop_list = list(self.stop)
        else:
            raise ValueError(f"stop={self.stop!r} must be a string or a list of strings")
        if any(s == "" for s in self._stop_list):
            raise ValueError("stop strings must not be empty; remove the empty string")
        if self.stop_token_ids is not None:
            if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers"
                )
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer in "
                             f"[{SEED_RANGE[0]}, {SEED_RANGE[1]}] or None")

    def _check_numbers(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {rule}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or (isinstance(v, float) and not math.isfinite(v)):
                raise bad(name, "it must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, "it must be an integer")
        if self.n < 1:
            raise bad("n", "it must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "it must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "it must be in (0, 1]; use 1.0 to disable")
        if self.top_k < -1:
            raise bad("top_k", "it must be an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "it must be in [0, 1]; use 0 to disable")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "it must be > 0; use 1.0 to disable")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "it must be in [-2, 2]; use 0 to disable")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "it must be an integer >= 1 (or None for the context limit)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "it must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"it must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "it must be an integer >= 0 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def stops_apply(self) -> bool:
        """Whether ``stop`` and ``stop_token_ids`` end the output: not when it is constrained,
        since a constrained output ends where its grammar ends (a stop string inside it would
        leave text that breaks the constraint)."""
        return self.structured_outputs is None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
