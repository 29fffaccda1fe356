"""Generated output -> Ollama's objects: /api/chat messages and /api/generate responses, streamed as NDJSON (one
JSON object a line, `"done": false` until the last) or collected into one; and Ollama's error shape.

The last object carries done_reason ("stop" or "length"; tool calls end as "stop", as in Ollama) and the counts
and times in nanoseconds: total_duration (from the request's arrival), load_duration (0: the model is loaded at
start), prompt_eval_count (prompt tokens), prompt_eval_duration (submission to first token), eval_count
(generated tokens), eval_duration (first to last token). Thinking goes to `thinking`, tool calls arrive whole
(arguments as an object), each in one chunk. A failure after the first line is one `{"error": ...}` line, then
the stream ends.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from server.api.agent_turn import OneTurn
from server.api.errors import APIError, from_engine_error
from server.api.generation import Choice
from server.api.output_blocks import Block, BlockEvent
from server.api.reasoning import ReasoningParser
from server.api.sse import SSEResponse
from server.api.streaming import ResponseContext, deltas

OLLAMA_ROUTE_PREFIX = "/api"


class NDJSONResponse(SSEResponse):
    """SSEResponse's delivery (disconnect watch, abort on close), as newline-delimited JSON."""

    media_type = "application/x-ndjson"


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def ndjson(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def created_at() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


class Clock:
    """When the request arrived, was submitted, and its first and latest tokens came: the final timings."""

    def __init__(self, arrived_at: float):
        self.arrived_at = arrived_at
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def saw(self, choice: Choice) -> None:
        if choice.completion_tokens:
            now = time.monotonic()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now

    def metrics(self, choice: Choice) -> dict[str, Any]:
        now = time.monotonic()
        first = self.first_token_at or now
        return {
            "done_reason": "length" if choice.finish_reason == "length" else "stop",
            "total_duration": _ns(now - self.arrived_at), "load_duration": 0,
            "prompt_eval_count": choice.prompt_tokens, "prompt_eval_duration": _ns(first - self.submitted_at),
            "eval_count": choice.completion_tokens, "eval_duration": _ns((self.last_token_at or first) - first),
        }


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _head(ctx: ResponseContext) -> dict[str, Any]:
    return {"model": ctx.model, "created_at": created_at()}


def tool_call(block: Block, index: int) -> dict[str, Any]:
    return {"id": block.call_id, "function": {"index": index, "name": block.name, "arguments": block.arguments()}}


class _ChatChunks:
    """Block events -> the `message` of one chat chunk: text, thinking, and tool calls once complete."""

    def __init__(self) -> None:
        self.num_calls = 0

    def message(self, events: list[BlockEvent]) -> dict[str, Any] | None:
        content, thinking, calls = [], [], []
        for event in events:
            if event.kind == "delta" and event.block.kind != "tool_call":
                (thinking if event.block.kind == "reasoning" else content).append(event.text)
            elif event.kind == "close" and event.block.kind == "tool_call":
                calls.append(tool_call(event.block, self.num_calls))
                self.num_calls += 1
        if not (content or thinking or calls):
            return None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if thinking:
            message["thinking"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        return message


async def stream_chat(ctx: ResponseContext, clock: Clock) -> AsyncIterator[str]:
    turn, chunks = OneTurn(ctx), _ChatChunks()
    try:
        async for events in turn.events(keepalive=False):
            clock.saw(turn.choice)
            message = chunks.message(events or [])
            if message is not None:
                yield ndjson({**_head(ctx), "message": message, "done": False})
        final = {"role": "assistant", "content": ""}
        yield ndjson({**_head(ctx), "message": final, "done": True, **clock.metrics(turn.choice)})
    except Exception as exc:
        yield ndjson({"error": from_engine_error(exc).message})


async def collect_chat(ctx: ResponseContext, clock: Clock) -> dict[str, Any]:
    turn = OneTurn(ctx)
    async for _ in turn.events(keepalive=False):
        clock.saw(turn.choice)
    blocks = turn.splitter.blocks
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
    thinking = "".join(b.text for b in blocks if b.kind == "reasoning")
    if thinking:
        message["thinking"] = thinking
    calls = [b for b in blocks if b.kind == "tool_call"]
    if calls:
        message["tool_calls"] = [tool_call(b, i) for i, b in enumerate(calls)]
    return {**_head(ctx), "message": message, "done": True, **clock.metrics(turn.choice)}


class _GenerateParts:
    """Text deltas of /api/generate -> (response, thinking): split at `<think>` when the chat template rendered
    the prompt, raw text otherwise."""

    def __init__(self, reasoning: ReasoningParser | None):
        self._reasoning = reasoning

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return text, ""
        pieces = self._reasoning.feed(text) if text else []
        if final:
            pieces += self._reasoning.finish()
        response = "".join(t for kind, t in pieces if kind == "content")
        return response, "".join(t for kind, t in pieces if kind == "reasoning")


def _generate_body(ctx: ResponseContext, response: str, thinking: str, done: bool) -> dict[str, Any]:
    body = {**_head(ctx), "response": response, "done": done}
    if thinking:
        body["thinking"] = thinking
    return body


async def stream_generate(ctx: ResponseContext, clock: Clock, reasoning: ReasoningParser | None) -> AsyncIterator[str]:
    parts = _GenerateParts(reasoning)
    try:
        async for choice, delta in deltas(ctx.generation):
            clock.saw(choice)
            final = delta.finish_reason is not None
            response, thinking = parts.split(delta.text, final)
            if response or thinking:
                yield ndjson(_generate_body(ctx, response, thinking, False))
            if final:
                yield ndjson({**_generate_body(ctx, "", "", True), **clock.metrics(choice)})
    except Exception as exc:
        yield ndjson({"error": from_engine_error(exc).message})


async def collect_generate(ctx: ResponseContext, clock: Clock, reasoning: ReasoningParser | None) -> dict[str, Any]:
    parts = _GenerateParts(reasoning)
    responses, thoughts = [], []
    choice = ctx.generation.choices[0]
    async for choice, delta in deltas(ctx.generation):
        clock.saw(choice)
        response, thinking = parts.split(delta.text, delta.finish_reason is not None)
        responses.append(response)
        thoughts.append(thinking)
    return {**_generate_body(ctx, "".join(responses), "".join(thoughts), True), **clock.metrics(choice)}

