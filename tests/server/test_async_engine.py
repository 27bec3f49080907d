"""The asyncio front in-process: a step that fails outside any one request (the model
forward) ends the requests it holds with the error, keeps no block, and drops the prefix
cache, since the failed step's blocks may be half written."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from qpage import SamplingParams
from qpage.server.async_engine import AsyncEngine, RequestFailedError

PARAMS = SamplingParams(temperature=0, max_tokens=4)


async def run_to_end(aengine: AsyncEngine, ids: list[int], rid: str) -> Any:
    (stream,) = await aengine.generate([{"prompt_token_ids": ids}], PARAMS, rid)
    last = None
    async for snap in stream:
        last = snap
    return last


def test_failed_forward_ends_requests_and_drops_prefix_cache(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.llm_engine
    ids = engine.tokenizer.encode("The history of printing " * 12, add_special_tokens=False)[:48]
    real = engine.runner.execute
    aengine = AsyncEngine(engine)
    aengine.start()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected forward fault")

    async def scenario() -> tuple[int, int]:
        monkeypatch.setattr(engine.runner, "execute", broken)
        with pytest.raises(RequestFailedError, match="injected forward fault"):
            await run_to_end(aengine, ids, "victim")
        monkeypatch.setattr(engine.runner, "execute", real)
        hits = engine.kv.prefix_hits
        final = await run_to_end(aengine, ids, "after")  # same prompt: nothing may come from the failed step
        assert final.finished and len(final.outputs[0].token_ids) == 4
        return hits, engine.kv.prefix_hits

    try:
        before, after = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert after == before  # no hit on blocks the failed step allocated
    assert aengine.error is None and engine.kv.usage() == 0.0
