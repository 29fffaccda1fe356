"""CPU-heavy work on request input (template rendering, tokenization) off the event loop.

One large prompt takes seconds to render and tokenize, one large response_format schema as long to compile into a
grammar (every constrained submission runs off the loop: llguidance releases the GIL while it compiles); on the
event loop every other client, /health included, would wait that long. Large inputs go to a few worker threads instead (bounded, so a burst of them cannot take
every core from the engine); small ones stay inline, where a thread hop would cost more than the work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from server.engine.types import InfillPrompt

T = TypeVar("T")
OFF_LOOP_CHARS = 1 << 15  # inputs at least this long leave the event loop
NUM_WORKERS = 2


class Offloader:
    """Runs input work inline or on a bounded set of worker threads, by the size of the input."""

    def __init__(self, num_workers: int = NUM_WORKERS, off_loop_chars: int = OFF_LOOP_CHARS):
        self.num_workers = num_workers
        self.off_loop_chars = off_loop_chars
        self._limiter: anyio.CapacityLimiter | None = None  # made on first use, inside the event loop

    async def run(self, num_chars: int, function: Callable[..., T], *args: Any, off_loop: bool = False,
                  **kwargs: Any) -> T:
        """`function(*args, **kwargs)`, off the loop when `num_chars` is large or `off_loop` says so."""
        if num_chars < self.off_loop_chars and not off_loop:
            return function(*args, **kwargs)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.num_workers)
        call = functools.partial(_outcome, function, args, kwargs)
        result, error = await anyio.to_thread.run_sync(call, limiter=self._limiter)
        if error is not None:
            try:
                raise error
            finally:
                del error  # this frame joins the error's traceback: holding the error too would make a cycle
        return result


def _outcome(function: Callable[..., T], args: tuple, kwargs: dict) -> tuple[T | None, Exception | None]:
    """The error comes back as a value: raised through anyio's future, it would stay in a reference cycle with
    that future (and keep the request's text and tokens alive until a full collection)."""
    try:
        return function(*args, **kwargs), None
    except Exception as exc:
        return None, exc


def input_chars(value: Any) -> int:
    """Characters of text in a prompt (a string, token ids or a fill-in-the-middle prompt) or in JSON-like request data, counted without
    recursion (the body's nesting is bounded already, but this stays cheap on any shape)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, InfillPrompt):
            stack.extend(item.texts())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            if item and isinstance(item[0], int):
                total += len(item)
            else:
                stack.extend(item)
    return total
