"""One generated assistant turn for the agent protocols (Anthropic Messages, OpenAI Responses): the prompt rendered
and submitted as chat completions do it, and the output read as block events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from server.api.chat_output import ChatOutputParser
from server.api.errors import from_engine_error
from server.api.generation import KEEPALIVE, Choice
from server.api.output_blocks import Block, BlockEvent, BlockSplitter
from server.api.reasoning import prompt_opens_reasoning
from server.api.routes import keepalive_s, start_generation
from server.api.state import ServingState
from server.api.streaming import ResponseContext, deltas
from server.engine.protocol import ServingEngine
from server.engine.types import SamplingParams


def render_prompt(engine: ServingEngine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any]) -> str:
    try:
        return engine.render_chat(messages, tools=tools, **template_kwargs)
    except Exception as exc:
        raise from_engine_error(exc, about_input=True) from None


async def start_turn(
    state: ServingState,
    engine: ServingEngine,
    prompt: str,
    params: SamplingParams,
    tools: list[dict[str, Any]] | None,
    *,
    request_id: str,
    started_at: float,
    prompt_param: str,
) -> ResponseContext:
    """Submit one choice of a rendered prompt; the context its response is built from."""
    generation = await start_generation(
        state, engine, [prompt], params, n=1, request_id=request_id, started_at=started_at, prompt_param=prompt_param,
    )
    return ResponseContext(
        id=request_id, created=int(time.time()), model=state.served_model_name,
        system_fingerprint=state.system_fingerprint, generation=generation, keepalive_s=keepalive_s(state),
        start_in_reasoning=prompt_opens_reasoning(prompt), tools=tools,
    )


class OneTurn:
    """The single choice of a generated assistant turn, read as block events."""

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.choice: Choice = ctx.generation.choices[0]
        self.splitter = BlockSplitter()
        self._parser: ChatOutputParser = ctx.chat_parser()
        self.stop_string: str | None = None  # the stop string that ended the output, if one did

    async def events(self, keepalive: bool = True) -> AsyncIterator[list[BlockEvent] | None]:
        """Block events as they arrive (the last batch closes the last block); None for a keepalive tick. An
        abort is raised as the error the client should see."""
        async for item in deltas(self.ctx.generation, self.ctx.keepalive_s if keepalive else None):
            if item is KEEPALIVE:
                yield None
                continue
            delta = item[1]
            parts = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                parts += self._parser.finish()
                self.stop_string = delta.stop_string
            events = self.splitter.feed(parts)
            if delta.finish_reason is not None:
                events += self.splitter.finish()
            yield events

    async def run(self) -> list[Block]:
        """Generate to the end (no keepalives); the final blocks."""
        async for _ in self.events(keepalive=False):
            pass
        return self.splitter.blocks

    @property
    def finish_reason(self) -> str:
        """"tool_calls" when the output stopped after tool calls, else the engine's reason (stop, length)."""
        reason = self.choice.finish_reason or "stop"
        return "tool_calls" if reason == "stop" and self.splitter.has_tool_calls else reason
