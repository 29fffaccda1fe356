"""HTTP endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

The `model` field of a request is not checked: this server serves one model, so the served name, an alias or
anything else (or nothing) selects it and never triggers a Hub lookup (mlx-lm#1133); responses carry the served
name (--served-model-name, else the MODEL argument), and /v1/models lists it first, then the aliases.

Tools: tool calls are parsed from the output only when tools reach the template. tool_choice "none" renders no
tools; a named function renders only that tool. "required", a named function and response_format are enforced
by a grammar (api.structured). Reasoning (`<think>`) is split out of chat output only; /v1/completions returns
the raw text.
"""

from __future__ import annotations

from functools import partial

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from server.api.errors import APIError, from_engine_error, validation_error, with_param_names
from server.api.generation import Generation, submit_choices
from server.api.json_checks import check_json_body
from server.api.messages import template_messages
from server.api.metrics import CONTENT_TYPE
from server.api.offload import input_chars
from server.api.reasoning import prompt_opens_reasoning
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.api.sse import SSEResponse, run_until_disconnect
from server.api.state import ServingState
from server.api.streaming import ResponseContext, collect_chat, collect_completion, stream_chat, stream_completion
from server.api.structured import chat_constraint, response_format_output
from server.engine.protocol import ServingEngine
from server.engine.types import InfillPrompt, InvalidRequestError, SamplingParams

T = TypeVar("T")
logger = logging.getLogger("mps_serve.api")
router = APIRouter()
# a per-request template is not accepted (vLLM also gates it behind a flag); these would clash with arguments
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "chat_template"}


def _state(request: Request) -> ServingState:
    return request.app.state.serving


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes (Content-Length first, then counted while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "Invalid Content-Length header.")
        if int(declared) > limit:
            raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
    request.state.body_bytes = size
    return await off_loop_for_body(request, _decode_body, b"".join(chunks))


async def off_loop_for_body(request: Request, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` off the event loop when the request's body is large: decoding and walking it, checking
    the schemas in it (a large response_format: ~0.1 s at 450 KB) or rendering it take time in proportion."""
    return await _state(request).offloader.run(getattr(request.state, "body_bytes", 0), function, *args)


def _decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError also covers numbers past int's digit limit
        raise APIError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    check_json_body(body)
    return body


def parse_body(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def keepalive_s(state: ServingState) -> float | None:
    interval = state.config.keepalive_interval_s
    return interval if interval and interval > 0 else None  # 0 turns keepalives off


def validate_params(params: SamplingParams, renamed: dict[str, str] | None = None) -> None:
    """SamplingParams.validate(), its `param` spelled as the request spelled it."""
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise with_param_names(from_engine_error(exc), renamed or {}) from None


async def start_generation(
    state: ServingState,
    engine: ServingEngine,
    prompts: list[str | list[int] | InfillPrompt],
    params: SamplingParams,
    *,
    n: int,
    request_id: str,
    started_at: float,
    prompt_param: str,
    param_names: dict[str, str] | None = None,
) -> Generation:
    """`param_names`: how the request spells fields that engine errors name otherwise."""
    try:
        choices = await submit_choices(
            engine, prompts, params, n=n, request_id=request_id, max_waiting=state.config.max_waiting_requests,
            offloader=state.offloader,
        )
    except Exception as exc:
        # the prompt is `messages` or `prompt`, whichever the request sent
        names = {"messages": prompt_param, "prompt": prompt_param, **(param_names or {})}
        raise with_param_names(_named_prompt(from_engine_error(exc, about_input=True), prompt_param), names) from None
    generation = Generation(choices, state.metrics, started_at)
    state.active.add(generation)
    logger.info("%s: %d choice(s), %d prompt tokens", request_id, len(choices), choices[0].prompt_tokens)
    return generation


def _named_prompt(err: APIError, prompt_param: str) -> APIError:
    """A context-length error's text names the prompt as the request did (Responses: `input`)."""
    if err.code == "context_length_exceeded" and prompt_param != "messages":
        err.message = err.message.replace("your messages", f"your {prompt_param}").replace(
            "the length of the messages", f"the length of the {prompt_param}")
    return err


async def respond(
    request: Request,
    state: ServingState,
    ctx: ResponseContext,
    stream: bool,
    streamer: Callable[[ResponseContext], AsyncIterator[str]],
    collector: Callable[[ResponseContext], Coroutine[Any, Any, dict[str, Any]]],
    stream_class: type[SSEResponse] = SSEResponse,
) -> Response:
    """`stream_class`: the streaming response (SSE, or Ollama's NDJSON)."""
    generation = ctx.generation

    async def close() -> None:
        await generation.aclose()
        state.active.discard(generation)

    if stream:
        return stream_class(streamer(ctx), on_close=close)
    try:
        completed, body = await run_until_disconnect(request.receive, collector(ctx))
    finally:
        await close()
    if not completed:
        logger.info("%s: client disconnected; request aborted", ctx.id)
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    return JSONResponse(body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    started_at = time.monotonic()
    state = _state(request)
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    tools = req.tools_for_template()
    messages = template_messages(req.messages)
    params = req.to_sampling_params(default_max_tokens=engine.max_model_len)
    max_tokens_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    validate_params(params, {"logprobs": "top_logprobs", "max_tokens": max_tokens_name})
    template_kwargs = {"enable_thinking": False} if req.reasoning_effort == "none" else {}
    template_kwargs |= {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        prompt = await state.offloader.run(
            input_chars(messages) + input_chars(tools), engine.render_chat, messages, tools=tools,
            add_generation_prompt=req.add_generation_prompt, **template_kwargs,
        )
    except Exception as exc:
        raise from_engine_error(exc, about_input=True) from None
    params.structured = await off_loop_for_body(request, chat_constraint, req, tools, prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await start_generation(
        state, engine, [prompt], params, n=req.n, request_id=request_id, started_at=started_at,
        prompt_param="messages",
    )
    ctx = ResponseContext(
        id=request_id, created=int(time.time()), model=state.served_model_name,
        system_fingerprint=state.system_fingerprint, generation=generation, include_usage=req.include_usage,
        keepalive_s=keepalive_s(state), logprobs=req.logprobs,
        reasoning_field=state.config.reasoning_field, start_in_reasoning=prompt_opens_reasoning(prompt), tools=tools,
    )
    return await respond(request, state, ctx, req.stream, stream_chat, collect_chat)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    started_at = time.monotonic()
    state = _state(request)
    req: CompletionRequest = parse_body(CompletionRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    ctx = await start_completion(request, state, engine, req, started_at)
    return await respond(request, state, ctx, req.stream, stream_completion, collect_completion)


async def start_completion(request: Request, state: ServingState, engine: ServingEngine, req: CompletionRequest, started_at: float,
                           reasoning: str = "none") -> ResponseContext:
    """A text completion submitted, fill-in-the-middle with a suffix (Ollama's /api/generate and /api/chat come
    here too); the context its response is built from. `reasoning`: how a response_format constraint treats
    reasoning first (structured.reasoning_mode)."""
    prompts = req.prompts()
    params = req.to_sampling_params(default_max_tokens=engine.max_model_len)
    validate_params(params, {"max_predict_ms": "t_max_predict_ms"})
    if req.response_format is not None:
        params.structured = await off_loop_for_body(request, partial(response_format_output, reasoning=reasoning),
                                                    req.response_format)
    echo_prompts: list[str] = []
    if req.echo:
        if not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "echo needs text prompts (token-id prompts cannot be echoed).", param="echo")
        echo_prompts = list(prompts)  # type: ignore[arg-type]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation = await start_generation(
        state, engine, prompts, params, n=req.n, request_id=request_id, started_at=started_at,
        prompt_param="prompt",
    )
    return ResponseContext(
        id=request_id, created=int(time.time()), model=state.served_model_name,
        system_fingerprint=state.system_fingerprint, generation=generation, include_usage=req.include_usage,
        keepalive_s=keepalive_s(state), logprobs=req.logprobs is not None, echo_prompts=echo_prompts,
    )


def _model_card(state: ServingState, model_id: str) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": state.created, "owned_by": "mps-serve"}
    if state.models is not None:
        engine = state.models.find(model_id).engine
        card["loaded"] = engine is not None
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
    elif state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.model_ids]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    state = _state(request)
    if model_id not in state.model_ids:
        served = ", ".join(repr(name) for name in state.model_ids)
        raise APIError(404, f"The model {model_id!r} does not exist; this server serves {served}.",
                       param="model", code="model_not_found")
    return _model_card(state, model_id)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    if state.draining:
        return APIError(503, "The server is shutting down.", code="server_shutdown").response()
    if not state.is_ready:
        return APIError(503, "The model is still loading.", code="model_loading").response()
    stats = state.read_stats()
    compile_state = stats.compile_state if stats is not None else "unknown"
    return JSONResponse({"status": "ok", "model": state.served_model_name, "compile": compile_state})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
