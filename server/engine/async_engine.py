"""AsyncEngine: the engine loop on a background thread, per-request asyncio queues for the HTTP layer.

The device work runs on one thread that owns the Engine; asyncio code talks to it only through a
command queue (add / abort) and receives StreamDeltas through `loop.call_soon_threadsafe`. So HTTP
handling never waits on the device, and an abort lands before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import Request
from server.engine.types import (
    ChatPrompt,
    EngineError,
    EngineStats,
    InfillPrompt,
    InvalidRequestError,
    ModelDescription,
    QueueFullError,
    SamplingParams,
    StepFailedError,
    StreamDelta,
)

log = logging.getLogger(__name__)
ENGINE_SWITCH_INTERVAL_S = 0.001


class AsyncRequestHandle:
    """One submitted request: async-iterable over its deltas, or pushing them to a sink after forward();
    abort() stops it inside the engine."""

    def __init__(self, owner: AsyncEngine, request: Request, loop: asyncio.AbstractEventLoop):
        self.request_id = request.request_id
        self.prompt_tokens = request.num_prompt_tokens
        self._owner = owner
        self.loop = loop
        self._queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._sink: Callable[[StreamDelta | BaseException | None], None] | None = None
        self._sink_closed = False
        self.finished = False

    def push(self, item: StreamDelta | BaseException) -> None:  # called from the engine thread
        self.loop.call_soon_threadsafe(self.accept, item)

    def accept(self, item: StreamDelta | BaseException) -> None:  # on the event loop
        if self._sink is None:
            self._queue.put_nowait(item)
            return
        if self._sink_closed:
            return  # a delta that was in flight when the stream ended (an abort)
        self._sink(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self._sink_closed = self.finished = True
            if not isinstance(item, BaseException):
                self._sink(None)

    def forward(self, sink: Callable[[StreamDelta | BaseException | None], None]) -> None:
        """From now on hand each item to `sink` as it arrives (see RequestHandle.forward)."""
        self._sink = sink
        while not self._queue.empty():
            self.accept(self._queue.get_nowait())

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamDelta]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            yield item
            if item.finish_reason is not None:
                self.finished = True
                return

    async def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.queue_abort(self.request_id)
            final = StreamDelta(self.request_id, "", [], finish_reason="abort")
            if self._sink is None:  # wake a reader blocked in _iterate; it sees `finished` and ends
                self._queue.put_nowait(final)
            elif not self._sink_closed:
                self.accept(final)


def put_all(items: list[tuple[AsyncRequestHandle, StreamDelta]]) -> None:
    for handle, delta in items:
        handle.accept(delta)


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting_requests: int = 256):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._handles: dict[str, AsyncRequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None  # until the first token is served: the start-up log line
        self._stopping = threading.Event()
        self._wakeup = threading.Event()
        self._stats = EngineStats()
        self._num_pending = 0  # submitted but not yet taken by the engine thread (both threads update it)
        self._pending_lock = threading.Lock()
        # where handles deliver: the loop start() ran on, so submit() may also run on a worker thread
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._description: ModelDescription | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting_requests: int = 256,
                    compile_beside_serving: bool = False) -> AsyncEngine:
        """`compile_beside_serving`: `compile_in_background` comes next (Engine.from_config)."""
        return cls(Engine.from_config(config, compile_beside_serving), max_waiting_requests)

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def render_chat(self, messages, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> str:
        text = self.engine.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return ChatPrompt(text)

    async def embed(self, prompts: list[str | list[int]], dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """Engine.embed on the engine thread, between two steps."""
        return await asyncio.to_thread(self.call, lambda: self.engine.embed(prompts, dimensions))

    def describe(self) -> ModelDescription:
        if self._description is None:  # fixed once loaded; reads only shapes and the config
            self._description = self.engine.describe()
        return self._description

    def count_tokens(self, prompt: str) -> int:
        return self.engine.inputs.count_tokens(prompt)

    def submit(self, prompt: str | list[int] | InfillPrompt, params: SamplingParams,
               request_id: str | None = None) -> AsyncRequestHandle:
        num_waiting = self._stats.num_waiting + self._num_pending
        if num_waiting >= self.max_waiting_requests:
            raise QueueFullError(num_waiting)
        if request_id is not None and request_id in self._handles:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        request = self.engine.inputs.make_request(prompt, params, request_id)  # validates; raises InvalidRequestError
        handle = AsyncRequestHandle(self, request, self._event_loop or asyncio.get_running_loop())
        self._handles[request.request_id] = handle
        with self._pending_lock:
            self._num_pending += 1
        self._commands.put(("add", request))
        self._wakeup.set()
        return handle

    def warm_up(self) -> float:
        """Engine.warm_up on the engine thread, which then serves (any per-thread device state warms where it is
        used). Returns its seconds."""
        return self.call(self.engine.warm_up)

    def compile_in_background(self):
        """Engine.compile_in_background, on the engine thread: serving starts at once, on the eager path, and moves
        to the compiled steps when they are ready. -> its BackgroundCompile, or None when nothing is to compile."""
        return self.call(self.engine.compile_in_background)

    def call(self, function: Callable[[], Any]) -> Any:
        """Run `function()` on the engine thread between steps, block until it is done; its result or error.
        Work that needs the Engine to itself (warm-up, a benchmark's reference run) only while idle; work that leaves
        the scheduler alone (an embedding forward) also while serving."""
        if threading.current_thread() is self._thread:
            return function()
        if self._stopping.is_set():
            raise EngineError("the engine is shutting down")
        self.start_thread()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (function, done)))
        self._wakeup.set()
        while True:  # the thread can end (shutdown) with the call still queued: do not wait for it forever
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    raise EngineError("the engine thread ended before running the call") from None

    async def stream(self, prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        handle = self.submit(prompt, params, request_id)
        try:
            async for delta in handle:
                yield delta
        finally:
            await handle.abort()  # no-op when it finished; frees the KV blocks when the caller left early

    def queue_abort(self, request_id: str) -> None:
        """Abort a request on the engine thread, between steps (any thread may call this)."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self.start_thread()

    def start_thread(self) -> None:
        if self._thread is None:
            # The engine thread must get the GIL back soon after its device wait, or the next step launches late
            # while the event loop serializes SSE chunks; CPython's default hand-over request comes after 5 ms,
            # a whole decode step. 1 ms bounds that wait (process-wide: the server process is ours).
            sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._loop, name="mps-serve-engine", daemon=True)
            self._started_at = time.perf_counter()
            self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        cache_saved = True  # nothing ran since the prefix cache's disk tier last had all cached blocks
        while not self._stopping.is_set():
            self._drain_commands()
            if not engine.has_unfinished:
                if not cache_saved:  # idle: write what memory caches, so a crash or kill loses little
                    cache_saved = self._save_prefix_cache()
                self._stats = engine.stats()
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            cache_saved = False
            try:
                deltas = engine.step()
            except StepFailedError as exc:  # only that step's requests fail; the engine serves on
                log.error("engine step failed; ending its %d request(s)", len(exc.request_ids), exc_info=exc.__cause__)
                self._fail(exc.request_ids, exc)
                continue
            except Exception as exc:  # a device failure must not leave clients hanging
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(EngineError(f"the engine failed while generating: {exc}"))
                continue
            self._deliver(deltas)
            self._stats = engine.stats()
        self._fail_all(EngineError("the server is shutting down"))
        self._save_prefix_cache(wait=True)  # the next process on this model starts from these prefixes

    def _save_prefix_cache(self, wait: bool = False) -> bool:
        try:
            return self.engine.save_prefix_cache(wait)
        except Exception:
            log.exception("could not save the prefix cache to disk")
            return True  # not again until more work ran

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, value = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._pending_lock:
                    self._num_pending -= 1
                handle = self._handles.get(value.request_id)
                if handle is None:
                    continue
                try:
                    self.engine.add_request(value)
                except ValueError as exc:  # e.g. a request id already in use: fail this request, not the loop
                    self._handles.pop(value.request_id, None)
                    handle.push(InvalidRequestError(str(exc), param="request_id"))
            elif kind == "call":  # a function to run on this thread (warm-up), its result to a Future
                function, done = value
                try:
                    done.set_result(function())
                except Exception as exc:
                    done.set_exception(exc)
            elif kind == "abort":
                delta = self.engine.abort(value)
                self._handles.pop(value, None)
                if delta is not None:
                    log.debug("aborted %s", value)

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        """One wake-up of each event loop per step, not one per token: with many streams the per-call cost of
        call_soon_threadsafe (a self-pipe write and a loop wake-up) adds up in SSE delivery."""
        if deltas and self._started_at is not None:  # the start-up phases end with the first token served
            log.info("first token served %.1f s after the engine started (compile: %s)",
                     time.perf_counter() - self._started_at, self.engine.compile_state)
            self._started_at = None
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncRequestHandle, StreamDelta]]] = {}
        for delta in deltas:
            handle = self._handles.get(delta.request_id)
            if handle is None:
                continue
            by_loop.setdefault(handle.loop, []).append((handle, delta))
            if delta.finish_reason is not None:
                self._handles.pop(delta.request_id, None)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail(list(self._handles), exc)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        """End these requests in the engine; each client gets `exc`'s message under its own request id."""
        for request_id in request_ids:
            self.engine.abort(request_id)
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                handle.push(EngineError(f"request {request_id}: {exc}"))
