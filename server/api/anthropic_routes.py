"""Anthropic Messages endpoints: POST /v1/messages and /v1/messages/count_tokens, on the chat-completions path
(same template rendering, engine submission, output parsers and limits); errors in Anthropic's shape.

tool_choice "any" is accepted but not enforced (no constrained decoding), as "required" in chat completions;
`disable_parallel_tool_use` is accepted and not enforced. Thinking blocks sent back in history are rendered as
the assistant's reasoning; their signatures are ignored.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from server.api.anthropic_output import collect_message, error_response, new_message_id, stream_messages
from server.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from server.api.errors import from_engine_error
from server.api.reasoning import prompt_opens_reasoning
from server.api.routes import keepalive_s, parse_body, read_json, respond, start_generation, validate_params
from server.api.state import ServingState
from server.api.streaming import ResponseContext
from server.engine.protocol import ServingEngine


class AnthropicRoute(APIRoute):
    """Every error raised by an endpoint answers in Anthropic's shape, with its status."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnect:
                raise
            except Exception as exc:
                return error_response(from_engine_error(exc))

        return handle


router = APIRouter(route_class=AnthropicRoute)


def _render(engine: ServingEngine, req: CountTokensRequest) -> tuple[str, list[dict[str, Any]] | None]:
    tools = req.tools_for_template()
    try:
        prompt = engine.render_chat(req.template_messages(), tools=tools, **req.template_kwargs())
    except Exception as exc:
        raise from_engine_error(exc, about_input=True) from None
    return prompt, tools


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    engine = state.ready_engine()
    req: MessagesRequest = parse_body(MessagesRequest, await read_json(request, state.config.max_request_body_bytes))
    params = req.to_sampling_params()
    validate_params(params, {"stop": "stop_sequences"})
    prompt, tools = _render(engine, req)
    message_id = new_message_id()
    generation = await start_generation(
        state, engine, [prompt], params, n=1, request_id=message_id, started_at=started_at, prompt_param="messages",
    )
    ctx = ResponseContext(
        id=message_id, created=int(time.time()), model=state.served_model_name,
        system_fingerprint=state.system_fingerprint, generation=generation, keepalive_s=keepalive_s(state),
        start_in_reasoning=prompt_opens_reasoning(prompt), tools=tools,
    )
    return await respond(request, state, ctx, req.stream, stream_messages, collect_message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    state: ServingState = request.app.state.serving
    engine = state.ready_engine()
    req: CountTokensRequest = parse_body(CountTokensRequest, await read_json(request, state.config.max_request_body_bytes))
    prompt, _ = _render(engine, req)
    return {"input_tokens": engine.count_tokens(prompt)}
