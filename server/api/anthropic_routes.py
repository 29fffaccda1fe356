"""Anthropic Messages endpoints: POST /v1/messages and /v1/messages/count_tokens, on the chat-completions path
(same template rendering, engine submission, output parsers and limits); errors in Anthropic's shape.

tool_choice "any" and "tool" are enforced by a grammar (api.structured), as "required" and a named function in
chat completions, with `disable_parallel_tool_use`; under "auto" the output stays free, so that flag is not
enforced there. Thinking blocks sent back in history are rendered as the assistant's reasoning; their signatures
are ignored. Without `thinking` the model does not think (the Messages API's default, whatever the template's);
thinking with a forced tool is refused, as Anthropic does; `budget_tokens` is validated as Anthropic does (at
least 1,024, under max_tokens) and enforced: after that many reasoning tokens the engine writes the template's
`</think>` itself and the answer follows (SamplingParams.reasoning_budget).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from server.api.agent_turn import render_prompt, start_turn
from server.api.anthropic_output import collect_message, error_response, new_message_id, stream_messages
from server.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from server.api.errors import from_engine_error, shaped_route
from server.api.routes import off_loop_for_body, parse_body, read_json, respond, validate_params
from server.api.state import ServingState

router = APIRouter(route_class=shaped_route(error_response))  # errors in Anthropic's shape


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    req: MessagesRequest = parse_body(MessagesRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    req.check_thinking()
    params = req.to_sampling_params()
    validate_params(params, {"stop": "stop_sequences"})
    tools = req.tools_for_template()
    prompt = await off_loop_for_body(request, render_prompt, engine, req.template_messages(), tools,
                                     req.template_kwargs())
    params.structured = await off_loop_for_body(request, req.constraint, prompt, tools)
    ctx = await start_turn(state, engine, prompt, params, tools, request_id=new_message_id(), started_at=started_at,
                           prompt_param="messages")
    return await respond(request, state, ctx, req.stream, stream_messages, collect_message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    state: ServingState = request.app.state.serving
    req: CountTokensRequest = parse_body(CountTokensRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    prompt = await off_loop_for_body(request, render_prompt, engine, req.template_messages(),
                                     req.tools_for_template(), req.template_kwargs())
    # any size, even past the context window; off the event loop when the body is large
    return {"input_tokens": await off_loop_for_body(request, engine.count_tokens, prompt)}
