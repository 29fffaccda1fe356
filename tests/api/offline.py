"""Run a response streamer or collector over scripted engine output without HTTP: fast enough to feed the same
text split at every position."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from server.api.generation import Choice, Generation
from server.api.metrics import Metrics
from server.api.streaming import ResponseContext
from server.engine.types import SamplingParams
from tests.api.fake_engine import FakeEngine, Script

METRICS = Metrics(lambda: None)


def run_offline(render: Callable[[ResponseContext], Any], pieces: list[str], *, stream: bool,
                tools: list[dict[str, Any]] | None = None, start_in_reasoning: bool = False, **script: Any) -> Any:
    """The streamed text (stream=True) or the collected body of `render` over `pieces`."""
    engine = FakeEngine(Script(pieces=pieces, **script))

    async def run() -> Any:
        await engine.start()
        handle = engine.submit("a prompt", SamplingParams(max_tokens=10_000))
        generation = Generation([Choice(0, 0, handle, prompt_tokens=handle.prompt_tokens)], METRICS, time.monotonic())
        ctx = ResponseContext(id="id-1", created=1, model="m", system_fingerprint="fp", generation=generation,
                              tools=tools, start_in_reasoning=start_in_reasoning)
        if stream:
            return "".join([text async for text in render(ctx)])
        return await render(ctx)

    return asyncio.run(run())
