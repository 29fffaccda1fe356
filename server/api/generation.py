"""The engine requests behind one HTTP request (n choices per prompt), submitted together and read as one
stream of (choice, delta) events, with keepalive ticks, metrics, and abort on close.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import anyio

from server.api.metrics import Metrics
from server.api.offload import Offloader, input_chars
from server.engine.protocol import RequestHandle, ServingEngine
from server.engine.types import InfillPrompt, QueueFullError, SamplingParams, StreamDelta

KEEPALIVE = None  # yielded by Generation.events() when nothing arrived for keepalive_s
_TICK = (None, None)  # what the keepalive timer queues in place of a (choice, item) pair


@dataclass
class Choice:
    index: int
    prompt_index: int
    handle: RequestHandle
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    num_tokens_seen: int = 0
    last_token_at: float | None = None
    ended: bool = False  # no more events will come for this choice


async def submit_choices(
    engine: ServingEngine,
    prompts: list[str | list[int] | InfillPrompt],
    params: SamplingParams,
    *,
    n: int,
    request_id: str,
    max_waiting: int,
    offloader: Offloader,
) -> list[Choice]:
    """Submit n requests per prompt; on any failure the ones already queued are aborted and it re-raises."""
    num_new = len(prompts) * n
    num_waiting = engine.stats().num_waiting
    if num_waiting + num_new > max_waiting:
        raise QueueFullError(num_waiting)
    choices: list[Choice] = []
    try:
        for prompt_index, prompt in enumerate(prompts):
            for j in range(n):
                # seeded n>1 choices differ from each other yet stay reproducible
                choice_params = params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)
                rid = request_id if num_new == 1 else f"{request_id}-{len(choices)}"
                # a grammar compiles in submit: seconds for a large schema, whatever the prompt's size
                handle = await offloader.run(input_chars(prompt), engine.submit, prompt, choice_params, request_id=rid,
                                             off_loop=params.structured is not None)
                choices.append(Choice(len(choices), prompt_index, handle, prompt_tokens=handle.prompt_tokens))
    except BaseException:
        with anyio.CancelScope(shield=True):
            for choice in choices:
                await choice.handle.abort()
        raise
    return choices


class Generation:
    def __init__(self, choices: list[Choice], metrics: Metrics, started_at: float):
        self.choices = choices
        self.server_aborted = False  # set when shutdown's grace period ran out
        self._metrics = metrics
        self._started_at = started_at
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._last_arrival = time.monotonic()  # when the latest item was queued (asyncio's clock too)
        self._keepalive: asyncio.TimerHandle | None = None

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[tuple[Choice, StreamDelta] | None]:
        """(choice, delta) in arrival order, and KEEPALIVE whenever nothing arrived for keepalive_s; a choice that
        ends without a finish reason ends as "abort". Raises the engine's exception if one of the requests fails."""
        for choice in self.choices:
            choice.handle.forward(functools.partial(self._enqueue, choice))
        if keepalive_s is not None:
            self._arm_keepalive(keepalive_s)
        remaining = len(self.choices)
        try:
            while remaining:
                entry = self._queue.get_nowait() if not self._queue.empty() else await self._queue.get()
                if entry is _TICK:
                    yield KEEPALIVE
                    continue
                choice, payload = entry
                if isinstance(payload, BaseException):
                    self._record_finish(choice, "error")
                    raise payload
                if payload is None:
                    if choice.ended:
                        continue
                    choice.ended = True
                    remaining -= 1
                    if choice.finish_reason is not None:
                        continue
                    payload = StreamDelta(choice.handle.request_id, text="", token_ids=[], finish_reason="abort")
                elif choice.finish_reason is not None:
                    continue  # nothing counts after the final delta
                self._observe(choice, payload)
                yield choice, payload
        finally:
            self._disarm_keepalive()

    def _arm_keepalive(self, keepalive_s: float) -> None:
        """One timer per generation, re-armed for when the stream will have been idle for keepalive_s: a timeout
        set and cancelled around each token's read would add event-loop work to every token."""
        loop = asyncio.get_running_loop()
        idle_s = time.monotonic() - self._last_arrival
        if idle_s >= keepalive_s:
            self._queue.put_nowait(_TICK)
            self._last_arrival, idle_s = time.monotonic(), 0.0
        self._keepalive = loop.call_later(keepalive_s - idle_s, self._arm_keepalive, keepalive_s)

    def _disarm_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    def _enqueue(self, choice: Choice, item: StreamDelta | BaseException | None) -> None:
        self._last_arrival = time.monotonic()
        self._queue.put_nowait((choice, item))  # an exception is re-raised by the consumer in the request's task

    def _observe(self, choice: Choice, delta: StreamDelta) -> None:
        now = time.monotonic()
        num_new = len(delta.token_ids)
        if num_new:
            if choice.last_token_at is None:
                self._metrics.time_to_first_token.observe(now - self._started_at)
                num_new -= 1  # the first token is TTFT; the rest of this delta arrived with it
            if num_new:
                gap = (now - choice.last_token_at) / num_new if choice.last_token_at is not None else 0.0
                for _ in range(num_new):
                    self._metrics.inter_token_latency.observe(gap)
            choice.last_token_at = now
        choice.num_tokens_seen += len(delta.token_ids)
        # deltas may carry running totals or nothing: take whichever count is larger
        choice.completion_tokens = max(choice.num_tokens_seen, delta.completion_tokens, choice.completion_tokens)
        choice.prompt_tokens = max(choice.prompt_tokens, delta.prompt_tokens)
        choice.cached_tokens = max(choice.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None:
            self._record_finish(choice, delta.finish_reason)

    def _record_finish(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        metrics = self._metrics
        metrics.requests_finished.labels(finish_reason=reason).inc()
        metrics.generation_tokens.inc(choice.completion_tokens)
        metrics.e2e_latency.observe(time.monotonic() - self._started_at)
        if choice.index == min(c.index for c in self.choices if c.prompt_index == choice.prompt_index):
            metrics.prompt_tokens.inc(choice.prompt_tokens)
            metrics.cached_prompt_tokens.inc(choice.cached_tokens)

    def usage(self) -> dict:
        """OpenAI usage: each prompt counted once (its first choice), completions summed over choices."""
        firsts = {}
        for choice in self.choices:
            firsts.setdefault(choice.prompt_index, choice)
        prompt_tokens = sum(c.prompt_tokens for c in firsts.values())
        completion_tokens = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts.values())},
        }

    async def abort(self, *, server: bool = False) -> None:
        """Abort every unfinished request; `server` marks a shutdown abort (the client is told why)."""
        self.server_aborted = self.server_aborted or server
        with anyio.CancelScope(shield=True):
            for choice in self.choices:
                if choice.finish_reason is None:
                    await choice.handle.abort()
                    # an aborted handle may end without a final delta, or not at all: end it here
                    self._queue.put_nowait((choice, None))

    async def aclose(self) -> None:
        """Idempotent: abort what still runs (client gone or error)."""
        if self._closed:
            return
        self._closed = True
        self._disarm_keepalive()  # in case the events() generator was dropped without being closed
        with anyio.CancelScope(shield=True):
            for choice in self.choices:
                if choice.finish_reason is None:
                    self._record_finish(choice, "abort")
                    await choice.handle.abort()
