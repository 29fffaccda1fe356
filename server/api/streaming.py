"""Engine deltas -> OpenAI chat and text-completion objects, streamed as SSE or collected into one response.

Stream rules, as OpenAI streams and its clients expect: one id and `created` on every chunk; first a role delta
`{"role":"assistant","content":""}`; the last chunk of each choice has an empty delta and the finish_reason;
with include_usage every chunk has `"usage":null` and one final chunk has `"choices":[]` and the usage;
`: keepalive` comments while nothing arrives; `data: [DONE]`. An error or an abort mid-stream is raised here and
becomes one `data: {"error":...}` event, and the stream closes (SSEResponse); so does a structured output whose
grammar could not go on (finish_reason "error" from the engine), a 400 when nothing was sent yet.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from server.api.chat_output import ChatOutputParser, MessageBuilder, chat_logprobs, completion_logprobs, delta_dicts
from server.api.errors import APIError
from server.api.generation import KEEPALIVE, Choice, Generation
from server.api.sse import DONE, KEEPALIVE_COMMENT, sse_data
from server.engine.types import StreamDelta, TokenLogprob


@dataclass
class ResponseContext:
    id: str
    created: int
    model: str
    system_fingerprint: str
    generation: Generation
    include_usage: bool = False
    keepalive_s: float | None = None
    logprobs: bool = False
    # chat only
    reasoning_field: str = "reasoning_content"
    start_in_reasoning: bool = False
    tools: list[dict[str, Any]] | None = None
    # completions only
    echo_prompts: list[str] = field(default_factory=list)

    def header(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def chat_parser(self) -> ChatOutputParser:
        return ChatOutputParser(start_in_reasoning=self.start_in_reasoning, tools=self.tools)


def abort_error(generation: Generation) -> APIError:
    if generation.server_aborted:
        return APIError(503, "The server is shutting down; the request was stopped.", code="server_shutdown")
    return APIError(500, "The engine stopped this request before it finished.", code="aborted")


def _chat_finish_reason(engine_reason: str, parser: ChatOutputParser) -> str:
    return "tool_calls" if engine_reason == "stop" and parser.has_tool_calls else engine_reason


async def stream_chat(ctx: ResponseContext) -> AsyncIterator[str]:
    header = ctx.header("chat.completion.chunk")

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: list[TokenLogprob] | None = None) -> str:
        rendered = chat_logprobs(logprobs) if logprobs and ctx.logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": rendered, "finish_reason": finish}
        obj = {**header, "choices": [choice]}
        if ctx.include_usage:
            obj["usage"] = None
        return sse_data(obj)

    gen = ctx.generation
    parsers = {c.index: ctx.chat_parser() for c in gen.choices}
    held_logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in gen.choices}
    for c in gen.choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})

    def on_delta(choice: Choice, delta: StreamDelta) -> Iterator[str]:
        parser = parsers[choice.index]
        parts = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parts += parser.finish()
        logprobs = held_logprobs[choice.index] + (delta.logprobs or [])
        for d in delta_dicts(parts, ctx.reasoning_field):
            yield chunk(choice.index, d, logprobs=logprobs)
            logprobs = []  # the tokens' logprobs go with the first chunk they produced
        held_logprobs[choice.index] = logprobs
        if delta.finish_reason is not None:
            yield chunk(choice.index, {}, _chat_finish_reason(delta.finish_reason, parser), logprobs=logprobs)

    async for line in _event_stream(ctx, header, on_delta):
        yield line


async def stream_completion(ctx: ResponseContext) -> AsyncIterator[str]:
    header = ctx.header("text_completion")
    gen = ctx.generation
    text_offsets = {c.index: 0 for c in gen.choices}

    def chunk(choice: Choice, text: str, finish: str | None = None, logprobs: list | None = None) -> str:
        rendered = None
        if ctx.logprobs and logprobs:
            rendered = completion_logprobs(logprobs, text_offsets[choice.index])
        text_offsets[choice.index] += len(text)
        body = {"index": choice.index, "text": text, "logprobs": rendered, "finish_reason": finish}
        obj = {**header, "choices": [body]}
        if ctx.include_usage:
            obj["usage"] = None
        return sse_data(obj)

    for c in gen.choices:
        if ctx.echo_prompts:
            yield chunk(c, ctx.echo_prompts[c.prompt_index])

    def on_delta(choice: Choice, delta: StreamDelta) -> Iterator[str]:
        if delta.text or delta.logprobs:
            yield chunk(choice, delta.text, logprobs=delta.logprobs)
        if delta.finish_reason is not None:
            yield chunk(choice, "", delta.finish_reason)

    async for line in _event_stream(ctx, header, on_delta):
        yield line


async def _event_stream(
    ctx: ResponseContext, header: dict, on_delta: Callable[[Choice, StreamDelta], Iterator[str]]
) -> AsyncIterator[str]:
    """What chat and text completions share: keepalives, an abort raised as an error, the usage chunk, [DONE]."""
    gen = ctx.generation
    async for item in deltas(gen, ctx.keepalive_s):
        if item is KEEPALIVE:
            yield KEEPALIVE_COMMENT
            continue
        for line in on_delta(*item):
            yield line
    if ctx.include_usage:
        yield sse_data({**header, "choices": [], "usage": gen.usage()})
    yield DONE


async def deltas(gen: Generation, keepalive_s: float | None = None) -> AsyncIterator[tuple[Choice, StreamDelta] | None]:
    """Generation.events(), with an abort raised as the error the client should see, and so an "error" finish
    (a structured output's grammar that could not go on: the text so far is no valid answer)."""
    async for item in gen.events(keepalive_s):
        if item is not KEEPALIVE and item[1].finish_reason == "abort":
            raise abort_error(gen)
        if item is not KEEPALIVE and item[1].finish_reason == "error":
            error = item[1].error
            if error is None:
                raise APIError(500, "The engine could not finish this request.", code="generation_error")
            raise APIError(400, error.message, param=error.param, code=error.code)
        yield item


async def collect_chat(ctx: ResponseContext) -> dict[str, Any]:
    gen = ctx.generation
    parsers = {c.index: ctx.chat_parser() for c in gen.choices}
    builders = {c.index: MessageBuilder(ctx.reasoning_field) for c in gen.choices}
    logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in gen.choices}
    async for choice, delta in deltas(gen):
        builders[choice.index].add(parsers[choice.index].feed(delta.text))
        if delta.finish_reason is not None:
            builders[choice.index].add(parsers[choice.index].finish())
        logprobs[choice.index].extend(delta.logprobs or [])
    choices = [
        {
            "index": c.index,
            "message": builders[c.index].message(),
            "logprobs": chat_logprobs(logprobs[c.index]) if ctx.logprobs else None,
            "finish_reason": _chat_finish_reason(c.finish_reason or "stop", parsers[c.index]),
        }
        for c in gen.choices
    ]
    return {**ctx.header("chat.completion"), "choices": choices, "usage": gen.usage()}


async def collect_completion(ctx: ResponseContext) -> dict[str, Any]:
    gen = ctx.generation
    texts = {c.index: [ctx.echo_prompts[c.prompt_index]] if ctx.echo_prompts else [] for c in gen.choices}
    logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in gen.choices}
    async for choice, delta in deltas(gen):
        texts[choice.index].append(delta.text)
        logprobs[choice.index].extend(delta.logprobs or [])
    choices = []
    for c in gen.choices:
        offset = len(ctx.echo_prompts[c.prompt_index]) if ctx.echo_prompts else 0
        rendered = completion_logprobs(logprobs[c.index], offset) if ctx.logprobs else None
        choices.append(
            {"index": c.index, "text": "".join(texts[c.index]), "logprobs": rendered, "finish_reason": c.finish_reason}
        )
    return {**ctx.header("text_completion"), "choices": choices, "usage": gen.usage()}
