"""POST /v1/responses (OpenAI Responses API, stateless) on the chat-completions path: same template rendering,
engine submission, output parsers and limits; errors in OpenAI's shape.

text.format (json_object, json_schema) and tool_choice "required" or a named function are enforced by a grammar,
as in chat completions (api.structured).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from server.api.agent_turn import render_prompt, start_turn
from server.api.responses_output import collect_response, new_response_id, stream_response
from server.api.responses_schemas import ResponsesRequest
from server.api.routes import off_loop_for_body, parse_body, read_json, respond, validate_params
from server.api.state import ServingState

router = APIRouter()


def _echo(req: ResponsesRequest, tools: list[dict[str, Any]] | None, max_tokens: int) -> dict[str, Any]:
    """The request settings a response object repeats."""
    return {
        "instructions": req.instructions, "max_output_tokens": max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": [{"type": "function", **t["function"]} for t in tools or []],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "text": {"format": _text_format(req)},
        "reasoning": req.reasoning.model_dump() if req.reasoning else None, "metadata": req.metadata or {},
    }


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    if req.text is None or req.text.format is None:
        return {"type": "text"}
    return req.text.format.model_dump(by_alias=True, exclude_none=True)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    req: ResponsesRequest = parse_body(ResponsesRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    req.check_stateless()
    params = req.to_sampling_params(default_max_tokens=engine.max_model_len)
    validate_params(params, {"max_tokens": "max_output_tokens"})
    tools = req.tools_for_template()
    prompt = await off_loop_for_body(request, render_prompt, engine, req.template_messages(), tools,
                                     req.template_kwargs())
    params.structured = await off_loop_for_body(request, req.constraint, prompt, tools)
    ctx = await start_turn(state, engine, prompt, params, tools, request_id=new_response_id(), started_at=started_at,
                           prompt_param="input")
    echo = _echo(req, tools, params.max_tokens)
    return await respond(request, state, ctx, req.stream, functools.partial(stream_response, echo=echo),
                         functools.partial(collect_response, echo=echo))
