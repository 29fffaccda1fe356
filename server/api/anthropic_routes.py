"""Anthropic Messages endpoints: POST /v1/messages and /v1/messages/count_tokens, on the chat-completions path
(same template rendering, engine submission, output parsers and limits); errors in Anthropic's shape.

tool_choice "any" and "tool" are enforced by a grammar (api.structured), as "required" and a named function in
chat completions, with `disable_parallel_tool_use`; under "auto" the output stays free, so that flag is not
enforced there. Thinking blocks sent back in history are rendered as the assistant's reasoning; their signatures
are ignored. Without `thinking` the model does not think (the Messages API's default, whatever the template's);
thinking with a forced tool is refused, as Anthropic does; `budget_tokens` is validated as Anthropic does (at
least 1,024, under max_tokens) but not enforced: the reasoning is bounded by max_tokens only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from server.api.agent_turn import render_prompt, start_turn
from server.api.anthropic_output import collect_message, error_response, new_message_id, stream_messages
from server.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from server.api.errors import from_engine_error
from server.api.routes import parse_body, read_json, respond, validate_params
from server.api.state import ServingState


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


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    engine = state.ready_engine()
    req: MessagesRequest = parse_body(MessagesRequest, await read_json(request, state.config.max_request_body_bytes))
    req.check_thinking()
    params = req.to_sampling_params()
    validate_params(params, {"stop": "stop_sequences"})
    tools = req.tools_for_template()
    prompt = render_prompt(engine, req.template_messages(), tools, req.template_kwargs())
    params.structured = req.constraint(prompt, tools)
    ctx = await start_turn(state, engine, prompt, params, tools, request_id=new_message_id(), started_at=started_at,
                           prompt_param="messages")
    return await respond(request, state, ctx, req.stream, stream_messages, collect_message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    state: ServingState = request.app.state.serving
    engine = state.ready_engine()
    req: CountTokensRequest = parse_body(CountTokensRequest, await read_json(request, state.config.max_request_body_bytes))
    prompt = render_prompt(engine, req.template_messages(), req.tools_for_template(), req.template_kwargs())
    # any size, even past the context window; off the event loop, as a body near the size limit takes a while
    return {"input_tokens": await asyncio.to_thread(engine.count_tokens, prompt)}
