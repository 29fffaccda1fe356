"""Generated output -> Anthropic Messages objects: the message body, its SSE event stream, and errors.

Stream order, as Anthropic sends it and its SDK accumulates it: message_start (usage so far), ping, per content
block content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta (stop_reason, stop_sequence, final usage) and message_stop. `ping` events
are the keepalives. A failure after the headers is one `error` event, then the stream closes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from server.api.agent_turn import OneTurn
from server.api.errors import APIError, from_engine_error
from server.api.generation import Choice
from server.api.output_blocks import Block, BlockEvent
from server.api.sse import sse_event
from server.api.streaming import ResponseContext

ANTHROPIC_ROUTE_PREFIX = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def error_body(err: APIError) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.param and err.param not in message:  # Anthropic's shape has no param: its messages lead with the field
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def usage(choice: Choice) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    return {
        "input_tokens": choice.prompt_tokens - choice.cached_tokens,
        "output_tokens": choice.completion_tokens,
        "cache_read_input_tokens": choice.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(turn: OneTurn) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = turn.finish_reason
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if turn.stop_string is not None:
        return "stop_sequence", turn.stop_string
    return "end_turn", None


def _message(ctx: ResponseContext, content: list[dict[str, Any]], turn: OneTurn, final: bool) -> dict[str, Any]:
    reason, sequence = stop_reason(turn) if final else (None, None)
    return {
        "id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": usage(turn.choice),
    }


def content_block(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments()}


def _block_event(event: BlockEvent) -> str:
    block = event.block
    if event.kind == "open":
        start = content_block(Block(block.index, block.kind, call_id=block.call_id, name=block.name))
        return sse_event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                 "content_block": start})
    if event.kind == "close":
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index})
    if block.kind == "reasoning":
        delta = {"type": "thinking_delta", "thinking": event.text}
    elif block.kind == "text":
        delta = {"type": "text_delta", "text": event.text}
    else:
        delta = {"type": "input_json_delta", "partial_json": event.text}
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})


def _ping() -> str:
    return sse_event("ping", {"type": "ping"})


async def stream_messages(ctx: ResponseContext) -> AsyncIterator[str]:
    turn = OneTurn(ctx)
    started = False
    try:
        async for events in turn.events():
            if not started:  # after the first engine event, so that usage counts the cached prompt tokens
                yield sse_event("message_start", {"type": "message_start", "message": _message(ctx, [], turn, False)})
                yield _ping()
                started = True
            if events is None:
                yield _ping()
                continue
            for event in events:
                yield _block_event(event)
        reason, sequence = stop_reason(turn)
        yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                             "stop_sequence": sequence},
                                          "usage": usage(turn.choice)})
        yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        yield sse_event("error", error_body(from_engine_error(exc)))


async def collect_message(ctx: ResponseContext) -> dict[str, Any]:
    turn = OneTurn(ctx)
    blocks = await turn.run()
    return _message(ctx, [content_block(b) for b in blocks], turn, True)
