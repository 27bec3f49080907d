"""Structured outputs: a request's constraint compiled to a grammar, and the grammar's
token mask applied to the logits.

The grammar library is XGrammar (vLLM's default; docs/structured-outputs.md says why, with
the measurements against llguidance). It compiles a JSON schema, regex, choice or EBNF
grammar once against the tokenizer's vocabulary, then tells, per step, which tokens may come
next as a bitmask of ``ceil(vocab / 32)`` int32 words.

Compiling: ``GrammarCompiler.compile`` is thread-safe and caches compiled grammars by their
text. The server compiles a request's grammar in a child process (``grammar_worker``), from a
thread of its own, and hands the result to ``LLMEngine.add_request``, so the step loop never
compiles; the offline API compiles in its own process when a request is added. Constraints
past ``MAX_CONSTRAINT_CHARS``, ``MAX_SCHEMA_DEPTH`` or ``schema_check.MAX_REPEAT`` are refused, since
their compile time grows without bound.

Matching: each sequence gets a ``Guide`` (its matcher). Before a step the engine writes every
constrained sampling row's allowed tokens (``token_masks``) into the scheduler's output, with
speculative decoding one row per draft token too (the tokens allowed after it); the runner's
sampler masks the batch with them in one operation; the engine feeds each kept token back
(``Guide.accept``); drafters cut a draft at its first token the grammar refuses. A preempted
request keeps its tokens (preemption recomputes the cache), so its matcher stays where it
is: nothing to roll back.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import math
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from qpage.engine.grammar_compile import compile_source
from qpage.engine.grammar_worker import CompileStopped, CompileWorker
from qpage.engine.schema_check import check_regex, check_repeats, check_schema
from qpage.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE_BYTES = 256 * 2**20
"""Bound on the compiled grammars kept (least recently used ones are dropped past it), so a
server that sees many distinct schemas does not grow without limit."""
REFUSALS_KEPT = 64
"""Constraints remembered as refused (with their error), so that a client repeating one does
not cost a compile each time; a compile that was stopped (time limit, cancelled) is not kept."""
MAX_JSON_WHITESPACE = 16
"""Most whitespace characters between two JSON tokens: enough for indented JSON, and it keeps
a sampled model from filling max_tokens with blank lines."""
MAX_CONSTRAINT_CHARS = 65536
"""Longest constraint accepted (a schema's JSON text, a regex, a grammar, the choices together)."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of objects and lists in a JSON schema (compile time grows steeply with it)."""
MASK_STEP_SHARE = 0.25
"""Share of a model step one request's grammar may take to compute its allowed tokens, in one
step (all its sequences together); past it the request is ended (``MaskBudget``)."""
MASK_FLOOR_S = 0.005
"""The budget is never below this, so that fast steps (a GPU) leave room for ordinary grammars."""
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _trim_heap() -> None:
    """Give freed heap pages back to the system (glibc's ``malloc_trim``; nothing elsewhere):
    grammars read back from the compile process leave their freed pages in the reading
    thread's malloc arena, where resident memory would stay at its high-water mark."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _xgrammar() -> Any:
    """The xgrammar module, imported on first use: it is optional, and slow to import, so
    an engine that never sees a constraint does not pay for it."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package: pip install xgrammar "
                         "(or pip install 'qpage[structured]')") from None


def _depth(node: Any, limit: int) -> int:
    """The nesting depth of objects and lists in ``node``, without recursion (a schema may
    nest past Python's recursion limit); the walk stops once the depth passes ``limit``."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        n, d = stack.pop()
        if isinstance(n, dict):
            children: Any = n.values()
        elif isinstance(n, list):
            children = n
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            break
        stack.extend((c, d + 1) for c in children)
    return deepest


def check_constraint(spec: StructuredOutputsParams) -> None:
    """ValueError if ``spec`` is past the size limits above, or says what the grammar would
    not enforce (``schema_check``: keywords, regex anchors, repetition counts); the message
    names the limit or keyword."""
    kind = spec.kind
    if kind == "json" and _depth(spec.json, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # first: it may not serialise
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it")
    text = json.dumps(spec.json) if kind == "json" else "".join(spec.choice or []) or spec.regex or spec.grammar or ""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the {kind} constraint has {len(text)} characters; at most {MAX_CONSTRAINT_CHARS} are taken")
    if kind == "json":
        check_schema(spec.json)
    elif kind == "regex":
        check_regex(spec.regex or "")
    elif kind == "grammar":
        check_repeats(spec.grammar or "", "the grammar")


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of ``choices`` (JSON string escapes are valid EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_source(spec: StructuredOutputsParams) -> tuple[str, str, dict[str, Any]]:
    """(kind, text, options) that XGrammar compiles for ``spec`` (``grammar_compile.compile_source``):
    schemas compile strict, so properties a schema does not name are not generated (any
    object for json_object, whose schema names none); choices become an EBNF grammar."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        options = {"strict_mode": kind == "json", "any_whitespace": not spec.disable_any_whitespace,
                   "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        return "json", json.dumps(spec.json if kind == "json" else {"type": "object"}), options
    if kind == "regex":
        return "regex", spec.regex or "", {}
    return "grammar", choice_grammar(spec.choice or []) if kind == "choice" else spec.grammar or "", {}


class GrammarCompiler:
    """Compiles constraints against one tokenizer, in this process or, once ``use_worker`` is
    called (the server), in a child process with a time and memory limit. Built on first use
    (reading the vocabulary takes a fraction of a second, which an engine that never sees a
    constraint should not pay).

    Compiled grammars are kept in a cache of our own, least recently used first out past
    ``cache_bytes`` of the grammars' memory: XGrammar's own cache keeps far more resident
    memory than it counts, while a compiled grammar's ``memory_size_bytes`` matches what the
    process holds for it (docs/structured-outputs.md has the curve). The last ``REFUSALS_KEPT``
    refused constraints are kept with their errors."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._stop = sorted(stop_token_ids)
        self._info: Any = None
        self._compiler: Any = None
        self.worker: CompileWorker | None = None
        self._cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self.cached_bytes = 0
        self._refused: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._base_rss = 0
        self._lock = threading.Lock()

    def _tokenizer_info(self) -> Any:
        xgr = _xgrammar()
        with self._lock:
            if self._info is None:
                try:
                    self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                    stop_token_ids=self._stop)
                except Exception as e:
                    raise ValueError(f"structured outputs are not available for this model's tokenizer ({e})") from e
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._info

    def use_worker(self, time_limit_s: float, memory_bytes: int) -> None:
        """Compile in a child process from now on (``grammar_worker``), under these limits.
        Nothing changes for a tokenizer XGrammar cannot read: each compile says so."""
        try:
            info = self._tokenizer_info()
        except ValueError:
            return
        self.worker = CompileWorker(info.serialize_json(), time_limit_s, memory_bytes)

    def _cached(self, key: tuple[str, str, str]) -> Any:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _keep(self, key: tuple[str, str, str], compiled: Any) -> None:
        """Cache ``compiled``; drop the least recently used grammars while the cache is past
        its bound by either count: the grammars' own sizes, or the process's resident memory
        measured against what it was when the cache was last empty (grammars read back from
        the compile process hold more than their stated size)."""
        with self._lock:
            if not self._cache:
                self._base_rss = _resident_bytes() - compiled.memory_size_bytes
            if key not in self._cache:
                self._cache[key] = compiled
                self.cached_bytes += compiled.memory_size_bytes
            grown = _resident_bytes() - self._base_rss
            while len(self._cache) > 1 and (self.cached_bytes > self.cache_bytes or grown > self.cache_bytes):
                self.cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
                _trim_heap()
                grown = _resident_bytes() - self._base_rss

    def compile(self, spec: StructuredOutputsParams, cancel: threading.Event | None = None) -> Any:
        """The compiled grammar of ``spec``; ValueError naming the constraint and the problem
        (``grammar_worker.CompileStopped`` when the worker ended it: time limit, ``cancel``)."""
        check_constraint(spec)
        info = self._tokenizer_info()
        kind, text, options = grammar_source(spec)
        key = (kind, text, json.dumps(options, sort_keys=True))
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        with self._lock:
            refused = self._refused.get(key)
        if refused is not None:
            raise ValueError(refused)
        try:
            if self.worker is not None:
                compiled = _xgrammar().CompiledGrammar.deserialize_json(
                    self.worker.compile(kind, text, options, cancel), info)
            else:
                compiled = compile_source(self._compiler, kind, text, options)
        except CompileStopped as e:
            raise CompileStopped(f"the {spec.kind} constraint was not compiled: {e}") from None
        except Exception as e:  # the library's errors (RuntimeError mostly) are about the input
            why = f"invalid {spec.kind}: {_CPP_PREFIX.sub('', str(e).strip())}"
            with self._lock:
                self._refused[key] = why
                while len(self._refused) > REFUSALS_KEPT:
                    self._refused.popitem(last=False)
            raise ValueError(why) from None
        self._keep(key, compiled)
        return compiled

    def guide(self, spec: StructuredOutputsParams) -> Guide:
        """A fresh matcher for ``spec`` (compiled, or taken from the cache)."""
        return Guide(self.compile(spec))


class Guide:
    """One sequence's matcher: which tokens may come next, advanced by the sampled ones. Draft
    tokens are checked and masked ahead of the state (``allowed_prefix``, ``fill`` with
    drafts) and rolled back: the state moves only by tokens the engine keeps."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] | tuple[int, ...] = ()) -> None:
        """Write this sequence's allowed tokens into ``bitmask[row]`` and, with ``drafts``, the
        tokens allowed after each draft into the rows after it (rows past a draft the grammar
        refuses, or past its end, are left as they are: no sampled token there is kept)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        taken = 0
        for t in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            taken += 1
            if not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bitmask, row + taken)
        self.rollback(taken)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self.matcher.accept_token(token))

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted ones."""
        if tokens:
            self.matcher.rollback(tokens)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (the state is unchanged)."""
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self.matcher.is_terminated())


def token_masks(guides: list[Guide], vocab_size: int, owners: list[str] | None = None,
                budget: MaskBudget | None = None,
                drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, dict[str, str]]:
    """([rows, ceil(vocab_size / 32)] int32, requests to end with why): for each guide in turn,
    1 + len(drafts[j]) consecutive rows (one without drafts), the tokens it allows next and
    after each of its drafts (``Guide.fill``), for the sampler (``runner.sampler.apply_bitmask``;
    bit k of word w = token 32w + k). ``owners[j]`` names the request of guide j. A request is
    ended, as its client's error, once its sequences have taken more than ``budget`` together,
    each counted per row (a verified draft makes a token as a step does; its remaining rows are
    left unfilled: all tokens allowed), or when its first row allows no token: the text so far
    can only go on with characters no token of the vocabulary produces."""
    drafts = drafts or [[] for _ in guides]
    bitmask = torch.full((sum(1 + len(d) for d in drafts), -(-vocab_size // 32)), -1, dtype=torch.int32)
    bound = math.inf if budget is None else budget.seconds
    spent: dict[str, float] = {}
    ended: dict[str, str] = {}
    row = 0
    for j, (g, d) in enumerate(zip(guides, drafts, strict=True)):
        owner = owners[j] if owners is not None else ""
        first, row = row, row + 1 + len(d)
        if owner in ended:
            continue
        t0 = time.perf_counter()
        g.fill(bitmask, first, d)
        spent[owner] = spent.get(owner, 0.0) + (time.perf_counter() - t0) / (1 + len(d))  # a draft row is a token
        if spent[owner] > bound:
            ended[owner] = budget.refusal(spent[owner])  # type: ignore[union-attr]
        elif not bitmask[first].any():
            ended[owner] = ("its constraint allows no token after the text so far: it goes on only with "
                            "characters that no token of this model's vocabulary produces; remove them from it")
    return bitmask, ended


class MaskBudget:
    """How long one request's grammar may take per step to say which tokens may come next:
    ``MASK_STEP_SHARE`` of a model step (a moving average of recent steps), at least
    ``MASK_FLOOR_S``. An ambiguous grammar's matcher can grow slower with every token (to
    hundreds of milliseconds per token); ending such a request bounds what it costs every
    other request in the batch to that share of a step."""

    def __init__(self) -> None:
        self.step_s: float | None = None

    def observe(self, seconds: float) -> None:
        """Record one model step's duration."""
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    @property
    def seconds(self) -> float:
        """The bound now (unbounded before the first step is timed)."""
        return math.inf if self.step_s is None else max(MASK_FLOOR_S, MASK_STEP_SHARE * self.step_s)

    def refusal(self, spent: float) -> str:
        """The error for a request whose grammar took ``spent`` seconds in one step."""
        return (f"its grammar took {spent * 1e3:.1f} ms to compute the allowed tokens for one step, more than "
                f"{self.seconds * 1e3:.1f} ms ({MASK_STEP_SHARE:.0%} of a model step); the grammar is too ambiguous "
                "to follow in bounded time: rewrite rules such as s ::= s s as right-recursive ones (s ::= x s | x)")
