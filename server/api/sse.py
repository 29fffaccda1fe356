"""Server-sent events framing, and responses that notice a client leaving while the engine works.

A stream that fails after its headers ends with one error event and closes, whatever raised (clients such as
openai-python raise on that event; no `[DONE]` follows, so none mistakes the stream for complete).

Starlette only watches for `http.disconnect` on older ASGI spec versions; here it is watched always, so a client
that goes away aborts its engine request at once, not at the next write (or, for non-streaming, never).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.api.errors import from_engine_error

DONE = "data: [DONE]\n\n"
KEEPALIVE_COMMENT = ": keepalive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(obj: Any) -> str:
    """One event: single-line JSON (line-based clients such as Zed and Continue need it) and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    """Streams `events`; on client disconnect the producer is cancelled and `on_close` runs (shielded)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(status_code=200, headers=SSE_HEADERS, media_type=self.media_type)
        self._events = _ending_with_error(events)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                try:
                    async for text in self._events:
                        await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the socket went away under a write: same as a disconnect
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close()
        if self.background is not None:
            await self.background()


async def _ending_with_error(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, and if they raise: one `data: {"error": ...}` event, then the stream closes. The 200 and the
    headers are already out, so the event is the only way left to tell the client; each event is written whole,
    so the client never sees half of one."""
    try:
        async for text in events:
            yield text
    except Exception as exc:
        yield sse_data(from_engine_error(exc).body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def run_until_disconnect(receive: Receive, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await `work` unless the client disconnects first: (True, result) or (False, None)."""
    outcome: dict[str, Any] = {}

    async with anyio.create_task_group() as group:

        async def run_work() -> None:
            try:
                outcome["result"] = await work
            except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup)
                outcome["error"] = exc
            group.cancel_scope.cancel()

        async def watch() -> None:
            await _wait_for_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(run_work)
        group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return ("result" in outcome, outcome.get("result"))


def sse_event(name: str, obj: Any) -> str:
    """A named event (`event:` line, then one single-line `data:`), as the Anthropic and Responses streams send."""
    return f"event: {name}\n{sse_data(obj)}"
