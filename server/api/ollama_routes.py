"""Ollama's generation endpoints on the same app and port: POST /api/chat, /api/generate, /api/embed and the older
/api/embeddings (ollama/ollama docs/api.md); errors in Ollama's shape `{"error": "..."}`.

Both generation endpoints submit through the text-completion path of /v1/completions (routes.start_completion):
/api/chat renders its messages with the model's chat template (as /v1/chat/completions does, so a greedy answer
is the same) and reads the output with the chat parsers (thinking, tool calls); /api/generate renders its
`prompt` (and `system`) as one user turn, unless `raw`, and passes `suffix` on as the completion's suffix, where
fill-in-the-middle lays out prompt and suffix itself (so no template then). `format` goes through the
structured-output path; `think` sets the template's thinking switch; `keep_alive` sets how long the model stays loaded
after the request when the server has several models (with one, it stays loaded while the server runs). A chat without messages, or a generate without prompt, only
answers `done_reason: "load"`, as Ollama does for a load request.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server.api.agent_turn import render_prompt
from server.api.embeddings import EmbeddingRequest
from server.api.errors import from_engine_error, shaped_route
from server.api.messages import template_messages
from server.api.ollama_output import (
    Clock,
    NDJSONResponse,
    collect_chat,
    collect_generate,
    created_at,
    error_response,
    stream_chat,
    stream_generate,
)
from server.api.ollama_schemas import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, keep_alive_seconds
from server.api.reasoning import ReasoningParser, prompt_opens_reasoning
from server.api.routes import parse_body, read_json, respond, start_completion
from server.api.schemas import CompletionRequest, Tool, check_parameters, check_tool_name
from server.api.state import ServingState
from server.api.structured import reasoning_mode
from server.engine.protocol import ServingEngine

router = APIRouter(route_class=shaped_route(error_response), include_in_schema=False)  # errors in Ollama's shape


async def _body(request: Request, model: type) -> tuple[ServingState, ServingEngine, Any]:
    state: ServingState = request.app.state.serving
    body = parse_body(model, await read_json(request, state.config.max_request_body_bytes))
    return state, await state.engine_for(body.model, keep_alive_seconds(body.keep_alive)), body


def _load_only(state: ServingState, body: dict[str, Any]) -> JSONResponse:
    """The answer to a request with nothing to generate: Ollama loads the model; here it is loaded already."""
    return JSONResponse({"model": state.served_model_name, "created_at": created_at(), **body, "done": True,
                         "done_reason": "load"})


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    for i, tool in enumerate(tools or []):
        check_tool_name(tool.function.name, f"tools[{i}].function.name")
        check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _completion(req: ChatRequest | GenerateRequest, engine: ServingEngine, prompt: str, suffix: str = "") -> CompletionRequest:
    """The text completion a chat or generate request stands for."""
    fields = {"prompt": "", "max_tokens": req.options.max_tokens(engine.max_model_len), **req.options.sampling_fields()}
    completion = parse_body(CompletionRequest, fields)
    completion.prompt = prompt  # set after validation: a rendered prompt keeps its ChatPrompt type (no second BOS)
    completion.suffix = suffix or None
    completion.response_format = req.response_format()
    return completion


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    arrived_at = time.monotonic()
    state, engine, req = await _body(request, ChatRequest)
    req.check_common()
    if not req.messages:
        return _load_only(state, {"message": {"role": "assistant", "content": ""}})
    tools = _tools(req.tools)
    prompt = render_prompt(engine, template_messages(req.chat_messages()), tools, req.template_kwargs())
    ctx = await start_completion(request, state, engine, _completion(req, engine, prompt), arrived_at,
                                 reasoning=reasoning_mode(prompt))
    ctx = dataclasses.replace(ctx, tools=tools, start_in_reasoning=prompt_opens_reasoning(prompt))
    clock = Clock(arrived_at)
    return await respond(request, state, ctx, req.stream, functools.partial(stream_chat, clock=clock),
                         functools.partial(collect_chat, clock=clock), NDJSONResponse)


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    arrived_at = time.monotonic()
    state, engine, req = await _body(request, GenerateRequest)
    req.check()
    if not req.prompt and not req.suffix:
        return _load_only(state, {"response": ""})
    prompt, reasoning = req.prompt, None
    if req.templated:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}]
        prompt = render_prompt(engine, messages, None, req.template_kwargs())
        reasoning = ReasoningParser(prompt_opens_reasoning(prompt))
    ctx = await start_completion(request, state, engine, _completion(req, engine, prompt, req.suffix), arrived_at,
                                 reasoning=reasoning_mode(prompt) if req.templated else "none")
    clock = Clock(arrived_at)
    return await respond(request, state, ctx, req.stream,
                         functools.partial(stream_generate, clock=clock, reasoning=reasoning),
                         functools.partial(collect_generate, clock=clock, reasoning=reasoning), NDJSONResponse)


async def _embed(engine: ServingEngine, inputs: Any, dimensions: int | None) -> tuple[list[list[float]], int]:
    prompts = EmbeddingRequest(input=inputs).prompts()
    try:
        return await engine.embed(prompts, dimensions)
    except Exception as exc:
        raise from_engine_error(exc, about_input=True) from None


@router.post("/api/embed")
async def embed(request: Request) -> dict[str, Any]:
    arrived_at = time.monotonic()
    state, engine, req = await _body(request, EmbedRequest)
    vectors, num_tokens = await _embed(engine, req.input, req.dimensions)
    return {"model": state.served_model_name, "embeddings": vectors, "load_duration": 0,
            "total_duration": round((time.monotonic() - arrived_at) * 1e9), "prompt_eval_count": num_tokens}


@router.post("/api/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    _, engine, req = await _body(request, EmbeddingsRequest)
    vectors, _ = await _embed(engine, req.prompt, None)
    return {"embedding": vectors[0]}
