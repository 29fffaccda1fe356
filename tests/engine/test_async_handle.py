"""AsyncEngine's request handle in push mode (forward): what the HTTP layer's Generation relies on."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from server.engine.async_engine import AsyncRequestHandle, put_all
from server.engine.types import EngineError, StreamDelta


def make_handle(loop):
    owner = SimpleNamespace(aborted=[])
    owner.queue_abort = owner.aborted.append
    request = SimpleNamespace(request_id="r1", num_prompt_tokens=3)
    return AsyncRequestHandle(owner, request, loop), owner


def delta(text, finish=None):
    return StreamDelta("r1", text, [7] if text else [], finish_reason=finish)


def test_forward_flushes_earlier_items_then_pushes_and_closes_after_the_final_delta():
    async def run():
        handle, _ = make_handle(asyncio.get_running_loop())
        got = []
        put_all([(handle, delta("a"))])  # arrived before anyone listened
        handle.forward(got.append)
        put_all([(handle, delta("b"))])
        handle.push(delta("c", "stop"))  # from the engine thread: lands on the loop
        await asyncio.sleep(0)
        put_all([(handle, delta("late"))])  # nothing after the end
        return got, handle.finished

    got, finished = asyncio.run(run())
    assert [d.text if d is not None else None for d in got] == ["a", "b", "c", None]
    assert finished


def test_forward_hands_over_an_engine_error_and_ends_without_none():
    async def run():
        handle, _ = make_handle(asyncio.get_running_loop())
        got = []
        handle.forward(got.append)
        handle.push(EngineError("device lost"))
        await asyncio.sleep(0)
        handle.push(delta("x"))
        await asyncio.sleep(0)
        return got

    got = asyncio.run(run())
    assert len(got) == 1 and isinstance(got[0], EngineError)


def test_abort_in_push_mode_tells_the_engine_and_ends_the_stream_once():
    async def run():
        handle, owner = make_handle(asyncio.get_running_loop())
        got = []
        handle.forward(got.append)
        put_all([(handle, delta("a"))])
        await handle.abort()
        await handle.abort()
        put_all([(handle, delta("in flight"))])
        return got, owner

    got, owner = asyncio.run(run())
    assert [d.finish_reason if d is not None else None for d in got] == [None, "abort", None]
    assert owner.aborted == ["r1"]


class _WarmUpEngine:
    """Just what the engine loop touches while idle, and a warm_up that records its thread."""

    model_name, max_model_len, has_unfinished = "fake", 16, False

    def __init__(self, error: Exception | None = None):
        self.error, self.threads = error, []

    def stats(self):
        from server.engine.types import EngineStats

        return EngineStats()

    def warm_up(self) -> float:
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return 1.5


def test_warm_up_runs_on_the_engine_thread_and_reports_its_result_or_error():
    from server.engine.async_engine import AsyncEngine

    engine = _WarmUpEngine()
    async_engine = AsyncEngine(engine)
    try:
        assert async_engine.warm_up() == 1.5
        assert engine.threads == ["mps-serve-engine"]  # the thread that goes on to serve
        engine.error = RuntimeError("compile failed")
        with pytest.raises(RuntimeError, match="compile failed"):
            async_engine.warm_up()
        assert async_engine.is_ready  # the loop survived the failure
        assert async_engine.call(lambda: async_engine.call(threading.current_thread)).name == "mps-serve-engine"
    finally:
        asyncio.run(async_engine.shutdown())
    with pytest.raises(EngineError, match="shutting down"):
        async_engine.call(lambda: 1)


def test_generation_keepalive_ticks_only_while_idle_and_its_timer_ends_with_the_stream():
    """One keepalive timer per generation: KEEPALIVE after keepalive_s without an item (before the first token and
    between tokens), none while tokens come faster than that, and no timer left once the stream ended."""
    from server.api.generation import KEEPALIVE, Choice, Generation
    from server.api.metrics import Metrics

    async def run():
        loop = asyncio.get_running_loop()
        handle, _ = make_handle(loop)
        gen = Generation([Choice(0, 0, handle)], Metrics(lambda: None), loop.time())
        events = []

        async def consume():
            async for item in gen.events(keepalive_s=0.1):
                events.append("ka" if item is KEEPALIVE else item[1].text)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.25)  # idle from the start: keepalives
        for piece in "abcdefgh":  # one token every 5 ms: no keepalive among them
            put_all([(handle, delta(piece))])
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.25)  # idle between tokens: keepalives again
        put_all([(handle, delta("z", "stop"))])
        await asyncio.wait_for(task, 5)
        return events, gen._keepalive

    events, timer = asyncio.run(run())
    first, rest = events[: events.index("a")], events[events.index("a"):]
    assert first and set(first) == {"ka"}
    assert rest[:8] == list("abcdefgh") and rest[-1] == "z"
    assert "ka" in rest[8:-1] and set(rest[8:-1]) == {"ka"}
    assert timer is None
