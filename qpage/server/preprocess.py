"""Request text to token ids, on the server's side of the engine.

The server keeps its own copy of the tokenizer and runs it on one worker thread: prompts
are tokenized, chat templates rendered and ``/tokenize`` and ``/detokenize`` answered there,
so a large prompt neither stalls the engine's step loop (which every client shares) nor
the event loop. Structured-output grammars go through the compile queue (``compile_queue``:
a compile process, clients in turn), so the engine thread never compiles one and a schema
that takes seconds to compile delays only its own client's constrained requests. A prompt the engine would refuse
(``check_prompt_ids``), or a ``max_tokens`` that does not fit beside it, is refused here
with the field it concerns; the tokenizer work is one queue, in arrival order, for all clients.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from qpage.engine.engine import check_prompt_ids
from qpage.engine.structured import GrammarCompiler
from qpage.sampling_params import StructuredOutputsParams
from qpage.server.chat_tokens import ContentGuard
from qpage.server.compile_queue import CompileQueue
from qpage.server.protocol import APIError
from qpage.server.tools import HERMES_OPEN

T = TypeVar("T")
Prompt = str | list[int]


class Preprocessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, chat_template: str | None = None,
                 grammars: GrammarCompiler | None = None, special_tokens_in_content: bool = False) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)  # not shared with the engine thread's detokenizers
        self.guard = None if special_tokens_in_content else ContentGuard(self.tokenizer)
        self.compiles = CompileQueue(grammars) if grammars is not None else None
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpage-tokenize")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.compiles is not None:
            self.compiles.shutdown()

    async def _run(self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", "tokens")
        return await self._run(self.tokenizer.decode, ids)

    async def render_chat(self, conv: list[dict[str, Any]], add_generation_prompt: bool,
                          continue_final: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        return await self._run(self._render, conv, add_generation_prompt, continue_final, tools)

    async def chat_ids(self, conv: list[dict[str, Any]], add_generation_prompt: bool,
                       continue_final: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation rendered and tokenized; special-token strings inside the messages
        and tools stay text (``chat_tokens``) unless the server trusts its clients."""
        return await self._run(self._chat_ids, conv, add_generation_prompt, continue_final, tools)

    @property
    def hermes_tools(self) -> bool:
        """Whether the chat template writes tool calls in the Hermes format (``server.tools``)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        return HERMES_OPEN in str(template)

    async def compile(self, spec: StructuredOutputsParams, param: str, client: str,
                      disconnected: Callable[[], Awaitable[bool]]) -> Any:
        """``spec`` compiled (for ``AsyncEngine.generate``) through the compile queue; 400
        naming ``param`` if it is invalid, 503 while the queue is full (``CompileQueue``)."""
        if self.compiles is None:
            raise APIError(400, "this server does not take structured outputs", param)
        return await self.compiles.compile(spec, param, client, disconnected)

    async def prompts(self, prompts: list[Prompt], add_special_tokens: bool, max_tokens: int | None,
                      param: str) -> list[dict[str, Any]]:
        """Each prompt as ``{"prompt_token_ids", "prompt"}``, checked against the context.
        ``max_tokens`` is the client's explicit value (None: fill the context); ``param``
        names the field the prompts came from, for errors."""
        return await self._run(self._prompts, prompts, add_special_tokens, max_tokens, param)

    # ------------------------------------------------------------------ worker thread
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _render(self, conv: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        tok = self.tokenizer
        if self.chat_template is None and not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions, or start the "
                                "server with --chat-template FILE")
        try:
            return tok.apply_chat_template(conv, chat_template=self.chat_template, tokenize=False, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final)
        except Exception as e:
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None

    def _chat_ids(self, conv: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool,
                  tools: list[dict[str, Any]] | None) -> list[int]:
        if self.guard is not None:
            (conv, tools), hit = self.guard.defuse((conv, tools))
            if hit:
                return self.guard.encode(self._render(conv, add_generation_prompt, continue_final, tools))
        return self._encode(self._render(conv, add_generation_prompt, continue_final, tools), False)

    def _prompts(self, prompts: list[Prompt], add_special_tokens: bool, max_tokens: int | None,
                 param: str) -> list[dict[str, Any]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids, text = self._encode(p, add_special_tokens), p
            else:
                ids, text = p, None
            self._check(ids, max_tokens, param)
            out.append({"prompt_token_ids": ids, "prompt": text})
        return out

    def _check(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        try:
            check_prompt_ids(ids, self.max_model_len, self.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        n, limit = len(ids), self.max_model_len
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {n} tokens and the context "
                                f"(max_model_len) is {limit}; ask for at most {limit - n}, or leave max_tokens out "
                                "to fill the context", "max_tokens")
