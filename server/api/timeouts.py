"""Deadlines for clients that hold a connection without sending: the request head, then the body.

uvicorn closes an idle connection only between requests (keep-alive); a client that connects and never sends a
byte, or stops in the middle of its headers, holds a socket and a file descriptor forever. The HTTP protocol
here closes a connection whose request head is not complete within `header_timeout_s` of the connection opening
(or of the previous response ending). Past the head, `BodyTimeoutMiddleware` answers 408 and closes when the
body stalls for `body_timeout_s` between two reads.
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.errors import APIError


def header_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing connections whose request head is late."""

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a pipelined request whose head is already in has started; otherwise the next head is awaited
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._header_timed_out)

        def _disarm_header_deadline(self) -> None:
            deadline = getattr(self, "_header_deadline", None)
            if deadline is not None:
                deadline.cancel()
                self._header_deadline = None

        def _header_timed_out(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.logger.info("%s: closed, no complete request head within %.0f s", self.client, header_timeout_s)
                self.transport.close()

    return HeaderDeadlineProtocol


class BodyTimeoutMiddleware:
    """A request body that stalls for `body_timeout_s` between two reads is answered 408, and the connection is
    closed. Once the body is complete, receive() is left alone: streams wait on it for the client's disconnect."""

    def __init__(self, app: ASGIApp, body_timeout_s: float):
        self.app = app
        self._timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(self._timeout_s):
                message = await receive()
                body_done = message["type"] != "http.request" or not message.get("more_body", False)
                return message
            raise APIError(408, f"The request body stalled for more than {self._timeout_s:g} s.",
                           code="request_timeout", headers={"Connection": "close"})

        await self.app(scope, receive_in_time, send)
