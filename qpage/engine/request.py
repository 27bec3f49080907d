"""One sequence being generated: its tokens, progress, blocks' hashes and timings."""

from __future__ import annotations

import enum
import hashlib
import random
import time
from array import array

from qpage.config import BLOCK_SIZE
from qpage.engine.structured import Guide
from qpage.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Hash of one full block, chained from its parent's hash so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


class Request:
    """A single sequence (one of the ``n`` completions of a prompt)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: set[int],
        *,
        parent_id: str | None = None,
        index: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        guide: Guide | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 until then
        self.num_preemptions = 0
        self.guide = guide
        """The structured-output matcher (None: unconstrained); it ends the request when complete."""
        self.draft_token_ids: list[int] = []
        """Speculative decoding: guessed next tokens, verified by the next step when it schedules them."""
        self._salt = (cache_salt or "").encode()
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()
        # The request's own random stream when seeded. Seeding from the text of (seed, index)
        # uses every bit of the 64-bit seed (a 32-bit seeding, as torch's CPU generator does,
        # would give seeds equal modulo 2**32 the same output).
        self.rng: random.Random | None = None
        if params.seed is not None:
            self.rng = random.Random(f"{params.seed}:{index}")
        # Sampling bookkeeping
        self.cumulative_logprob = 0.0
        # Timings (monotonic seconds)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    # ------------------------------------------------------------------ tokens
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        full = len(self.all_token_ids) // BLOCK_SIZE
        while len(self.block_hashes) < full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            toks = self.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            self.block_hashes.append(hash_block(parent, toks, self._salt))

    # ------------------------------------------------------------------ stops
    def stop_status(self, max_model_len: int, stop_string: str | None = None) -> RequestStatus | None:
        """Whether the last token ends the request, and how: the one place that decides. In
        order: a stop string the detokenizer found (it waits for ``min_tokens``), the grammar's
        end, EOS and stop tokens (once ``min_tokens`` are out), then the length limits. Stop
        strings and tokens do not apply to a constrained output (``SamplingParams.stops_apply``).
        Sets ``stop_reason`` to the stop string or token that ended it."""
        n_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        p = self.params
        if not p.stops_apply:
            if self.guide is not None and self.guide.terminated:
                return RequestStatus.FINISHED_STOPPED
        elif stop_string is not None:
            self.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        elif n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and last in p.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
