"""The server's OpenAPI document: FastAPI's paths with the request bodies the handlers validate themselves.

The handlers read their JSON body by hand (size limit, JSON checks, errors in OpenAI's shape), so FastAPI sees no
body parameter; the pydantic request models supply the bodies here. Every operation may answer an OpenAI error.
Not served over HTTP (the app has no /openapi.json); `app.openapi()` returns it, and the schema fuzz test uses it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.api.schemas import ChatCompletionRequest, CompletionRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
_REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, openapi_version="3.1.0", routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    for path, model in REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template=_REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    error = {"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.setdefault("responses", {})["default"] = error
    return schema


def install_openapi(app: FastAPI) -> None:
    """`app.openapi()` returns the full document (built once)."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(openapi_schema(app))
        return built

    app.openapi = openapi  # type: ignore[method-assign]
