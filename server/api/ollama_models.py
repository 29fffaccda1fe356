"""Ollama's model endpoints: GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, POST /api/pull,
DELETE /api/delete; errors in Ollama's shape.

One model is served, so /api/tags and /api/ps list it (under its served name and aliases) and /api/show
describes it whatever name is asked for, as any name selects it elsewhere. `digest` names the served checkpoint
(a hash of its name and source), not a file. /api/version reports the Ollama release whose API this follows. `template` is the model's Jinja chat template, not a Go template.
/api/pull downloads a Hub repo into the Hugging Face cache and /api/delete removes one from it (ollama_hub); the
served model stays the one loaded at start, and deleting it is refused.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api import ollama_hub
from server.api.errors import APIError, shaped_route
from server.api.model_registry import ModelSlot
from server.api.ollama_output import NDJSONResponse, error_response, ndjson
from server.api.ollama_schemas import ModelRequest
from server.api.routes import parse_body, read_json
from server.api.state import ServingState
from server.engine.types import ModelDescription
from server.version import installed_version

router = APIRouter(route_class=shaped_route(error_response), include_in_schema=False)  # errors in Ollama's shape
NEVER = "9999-12-31T23:59:59Z"  # expires_at: the model is never unloaded while the server runs
# The Ollama release whose API (docs/api.md) these endpoints follow: clients gate features on /api/version
# (VS Code Copilot's Ollama provider needs 0.6.4 or later), so it reports this, and mps-serve's own version apart.
OLLAMA_API_VERSION = "0.33.0"


_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # Ollama's spelling of unquantized weights


def parameter_size(count: int) -> str:
    """Ollama's spelling: "8.0B", "596.0M", "253.2K"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def details(model: ModelDescription) -> dict[str, Any]:
    level = _LEVELS.get(model.quantization or model.dtype, (model.quantization or model.dtype).upper())
    return {"parent_model": "", "format": "safetensors", "family": model.model_type, "families": [model.model_type],
            "parameter_size": parameter_size(model.parameter_count), "quantization_level": level}


def capabilities(model: ModelDescription) -> list[str]:
    if model.embedding:
        return ["embedding"]
    template = model.chat_template or ""
    found = ["completion"]
    if "tools" in template:
        found.append("tools")
    if "enable_thinking" in template or "<think>" in template:
        found.append("thinking")
    return found


def _entry(state: ServingState, name: str) -> dict[str, Any]:
    model = state.ready_engine().describe()
    source = f"{name}\0{state.engine.model_name}".encode()
    return {"name": name, "model": name, "size": model.weight_bytes, "digest": hashlib.sha256(source).hexdigest(),
            "details": details(model)}


def _slot_entry(name: str, slot: ModelSlot) -> dict[str, Any]:
    """One of several models: described by its engine while loaded, else by its estimated size alone."""
    source = f"{name}\0{slot.spec.name}".encode()
    entry = {"name": name, "model": name, "size": slot.spec.size_bytes, "digest": hashlib.sha256(source).hexdigest(),
             "details": {"parent_model": "", "format": "safetensors", "family": "", "families": [],
                         "parameter_size": "", "quantization_level": ""}, "loaded": slot.engine is not None}
    if slot.engine is not None:
        model = slot.engine.describe()
        entry |= {"size": model.weight_bytes, "details": details(model)}
    return entry


def _expires(slot: ModelSlot) -> str:
    if slot.expires_at is None:
        return NEVER
    return datetime.datetime.fromtimestamp(slot.expires_at, datetime.UTC).isoformat().replace("+00:00", "Z")


def _loaded_entry(name: str, slot: ModelSlot) -> dict[str, Any]:
    model = slot.engine.describe()
    on_gpu = model.weight_bytes if model.device != "cpu" else 0
    return {**_slot_entry(name, slot), "expires_at": _expires(slot), "size_vram": on_gpu,
            "context_length": model.max_model_len}


def _state(request: Request) -> ServingState:
    return request.app.state.serving


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    state = _state(request)
    if state.models is not None:
        return {"models": [{**_slot_entry(item["name"], item["slot"]), "modified_at": state.created_at}
                           for item in state.models.listing()]}
    return {"models": [{**_entry(state, name), "modified_at": state.created_at} for name in state.model_ids]}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    state = _state(request)
    if state.models is not None:
        return {"models": [_loaded_entry(item["name"], item["slot"]) for item in state.models.listing()
                           if item["loaded"]]}
    model = state.ready_engine().describe()
    on_gpu = model.weight_bytes if model.device != "cpu" else 0
    return {"models": [{**_entry(state, name), "expires_at": NEVER, "size_vram": on_gpu,
                        "context_length": model.max_model_len} for name in state.model_ids]}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "mps_serve_version": installed_version()}


@router.post("/api/show")
async def show(request: Request) -> dict[str, Any]:
    state = _state(request)
    req = parse_body(ModelRequest, await read_json(request, state.config.max_request_body_bytes))
    model = (await state.engine_for(req.model_name)).describe()
    arch = model.model_type
    info = {"general.architecture": arch, "general.parameter_count": model.parameter_count,
            f"{arch}.context_length": model.max_model_len, f"{arch}.embedding_length": model.hidden_size,
            f"{arch}.block_count": model.num_layers, f"{arch}.vocab_size": model.vocab_size}
    # `parameters` as a Modelfile lists them: editors (Continue) read the context length from num_ctx
    parameters = f"num_ctx {model.max_model_len}"
    return {"modelfile": "", "parameters": parameters, "template": model.chat_template or "", "details": details(model),
            "model_info": info, "capabilities": capabilities(model), "modified_at": state.created_at}


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    state = _state(request)
    req = parse_body(ModelRequest, await read_json(request, state.config.max_request_body_bytes))
    name = req.model_name
    if name in state.model_ids or (state.engine is not None and name == state.engine.model_name):
        events = _served(name)
    else:
        try:
            plan = await ollama_hub.plan_pull(name)
        except APIError as err:
            if not req.stream:
                raise
            events = _failed(err)  # as Ollama answers a failed pull: 200, and the error as the stream's line
        else:
            events = ollama_hub.pull_events(plan, state.served_model_name)
    if req.stream:
        return NDJSONResponse(_lines(events), on_close=_nothing)
    async for event in events:
        if "error" in event:
            raise APIError(502, event["error"])
    return JSONResponse({"status": "success"})


async def _served(name: str) -> AsyncIterator[dict[str, Any]]:
    yield {"status": f"{name} is the model this server serves; nothing to pull"}
    yield {"status": "success"}


async def _failed(err: APIError) -> AsyncIterator[dict[str, Any]]:
    yield {"error": err.message}


async def _lines(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield ndjson(event)


async def _nothing() -> None:
    """A pull holds no engine request to abort when its client leaves."""


@router.delete("/api/delete")
async def delete(request: Request) -> Response:
    state = _state(request)
    name = parse_body(ModelRequest, await read_json(request, state.config.max_request_body_bytes)).model_name
    served = set(state.model_ids) | ({state.engine.model_name} if state.engine is not None else set())
    await ollama_hub.delete(name, served)
    return Response(status_code=200)
