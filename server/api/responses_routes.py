"""POST /v1/responses (OpenAI Responses API, stateless) on the chat-completions path: same template rendering,
engine submission, output parsers and limits; errors in OpenAI's shape.

tool_choice "required" is accepted but not enforced (no constrained decoding), as in chat completions.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from server.api.errors import from_engine_error
from server.api.reasoning import prompt_opens_reasoning
from server.api.responses_output import collect_response, new_response_id, stream_response
from server.api.responses_schemas import ResponsesRequest
from server.api.routes import keepalive_s, parse_body, read_json, respond, start_generation, validate_params
from server.api.state import ServingState
from server.api.streaming import ResponseContext

router = APIRouter()


def _echo(req: ResponsesRequest, tools: list[dict[str, Any]] | None, max_tokens: int) -> dict[str, Any]:
    """The request settings a response object repeats."""
    return {
        "instructions": req.instructions, "max_output_tokens": max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": [{"type": "function", **t["function"]} for t in tools or []],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "text": {"format": {"type": "text"}},
        "reasoning": req.reasoning.model_dump() if req.reasoning else None, "metadata": req.metadata or {},
    }


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    engine = state.ready_engine()
    req: ResponsesRequest = parse_body(ResponsesRequest, await read_json(request, state.config.max_request_body_bytes))
    req.check_stateless()
    params = req.to_sampling_params(default_max_tokens=engine.max_model_len)
    validate_params(params, {"max_tokens": "max_output_tokens"})
    tools = req.tools_for_template()
    try:
        prompt = engine.render_chat(req.template_messages(), tools=tools, **req.template_kwargs())
    except Exception as exc:
        raise from_engine_error(exc, about_input=True) from None
    response_id = new_response_id()
    generation = await start_generation(
        state, engine, [prompt], params, n=1, request_id=response_id, started_at=started_at, prompt_param="input",
    )
    ctx = ResponseContext(
        id=response_id, created=int(time.time()), model=state.served_model_name,
        system_fingerprint=state.system_fingerprint, generation=generation, keepalive_s=keepalive_s(state),
        start_in_reasoning=prompt_opens_reasoning(prompt), tools=tools,
    )
    echo = _echo(req, tools, params.max_tokens)
    return await respond(request, state, ctx, req.stream, functools.partial(stream_response, echo=echo),
                         functools.partial(collect_response, echo=echo))
