"""Generated output -> OpenAI Responses objects: the response, and its SSE event stream.

Stream order, as OpenAI documents it: response.created, response.in_progress; per output item
response.output_item.added, then for a message (or reasoning) response.content_part.added,
response.output_text.delta (response.reasoning_text.delta) ..., their .done, response.content_part.done, and for
a function call response.function_call_arguments.delta ... / .done; response.output_item.done; finally
response.completed (response.incomplete when max_output_tokens cut it short). Every event carries `type` and an
increasing `sequence_number`. A failure after the headers is one `error` event, then the stream closes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.api.agent_turn import OneTurn
from server.api.errors import from_engine_error
from server.api.output_blocks import Block, BlockEvent
from server.api.sse import KEEPALIVE_COMMENT, sse_event
from server.api.streaming import ResponseContext

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Output items and the response object of one turn; `echo` holds the request settings a response repeats."""

    def __init__(self, ctx: ResponseContext, echo: dict[str, Any]):
        self.ctx, self.echo = ctx, echo
        self.turn = OneTurn(ctx)
        self._item_ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        return self._item_ids.setdefault(block.index, f"{_ITEM_PREFIX[block.kind]}_{uuid.uuid4().hex}")

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if block.kind == "tool_call":
            return {"id": self.item_id(block), "type": "function_call", "status": status, "call_id": block.call_id,
                    "name": block.name, "arguments": block.text if done else ""}
        content = [self.part(block)] if done else []
        if block.kind == "reasoning":
            return {"id": self.item_id(block), "type": "reasoning", "status": status, "summary": [], "content": content}
        return {"id": self.item_id(block), "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(block: Block, text: str | None = None) -> dict[str, Any]:
        text = block.text if text is None else text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        incomplete = status == "incomplete"
        body = {
            "id": self.ctx.id, "object": "response", "created_at": self.ctx.created, "status": status,
            "model": self.ctx.model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": [self.item(b, True) for b in self.turn.splitter.blocks] if done else [],
            "usage": self.usage() if done else None,
            "previous_response_id": None, "store": False,
        }
        return {**body, **self.echo}

    @property
    def final_status(self) -> str:
        return "incomplete" if self.turn.finish_reason == "length" else "completed"

    def usage(self) -> dict[str, Any]:
        choice = self.turn.choice
        return {
            "input_tokens": choice.prompt_tokens,
            "input_tokens_details": {"cached_tokens": choice.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": choice.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},  # not counted apart from the rest of the output
            "total_tokens": choice.prompt_tokens + choice.completion_tokens,
        }


class _Sequencer:
    def __init__(self) -> None:
        self.number = 0

    def event(self, event_type: str, /, **fields: Any) -> str:
        text = sse_event(event_type, {"type": event_type, "sequence_number": self.number, **fields})
        self.number += 1
        return text


def _block_events(out: ResponseBuilder, seq: _Sequencer, event: BlockEvent) -> list[str]:
    block = event.block
    where = {"item_id": out.item_id(block), "output_index": block.index}
    if block.kind == "tool_call":
        if event.kind == "open":
            return [seq.event("response.output_item.added", output_index=block.index, item=out.item(block, False))]
        if event.kind == "delta":
            return [seq.event("response.function_call_arguments.delta", **where, delta=event.text)]
        return [seq.event("response.function_call_arguments.done", **where, name=block.name, arguments=block.text),
                seq.event("response.output_item.done", output_index=block.index, item=out.item(block, True))]
    text_event = "response.reasoning_text" if block.kind == "reasoning" else "response.output_text"
    extra = {} if block.kind == "reasoning" else {"logprobs": []}
    if event.kind == "open":
        return [seq.event("response.output_item.added", output_index=block.index, item=out.item(block, False)),
                seq.event("response.content_part.added", **where, content_index=0, part=out.part(block, ""))]
    if event.kind == "delta":
        return [seq.event(f"{text_event}.delta", **where, content_index=0, delta=event.text, **extra)]
    return [seq.event(f"{text_event}.done", **where, content_index=0, text=block.text, **extra),
            seq.event("response.content_part.done", **where, content_index=0, part=out.part(block)),
            seq.event("response.output_item.done", output_index=block.index, item=out.item(block, True))]


async def stream_response(ctx: ResponseContext, echo: dict[str, Any]) -> AsyncIterator[str]:
    out, seq = ResponseBuilder(ctx, echo), _Sequencer()
    try:
        yield seq.event("response.created", response=out.response("in_progress"))
        yield seq.event("response.in_progress", response=out.response("in_progress"))
        async for events in out.turn.events():
            if events is None:
                yield KEEPALIVE_COMMENT
                continue
            for event in events:
                for text in _block_events(out, seq, event):
                    yield text
        status = out.final_status
        yield seq.event(f"response.{status}", response=out.response(status))
    except Exception as exc:
        err = from_engine_error(exc)
        yield seq.event("error", code=err.code or err.type, message=err.message, param=err.param)


async def collect_response(ctx: ResponseContext, echo: dict[str, Any]) -> dict[str, Any]:
    out = ResponseBuilder(ctx, echo)
    await out.turn.run()
    return out.response(out.final_status)
