"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a real HTTP status.

Every failure the server can name maps here, so a client mistake is a 4xx (openai-python retries 5xx) and
FastAPI's default `{"detail": ...}` body never reaches a client.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from server.engine.types import EngineError, InvalidRequestError, ModelLoadError, QueueFullError

logger = logging.getLogger("mps_serve.api")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI: code "invalid_api_key"
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_engine_error(exc: Exception, *, about_input: bool = False) -> APIError:
    """Map an engine exception to the error a client should see. `about_input`: raised while rendering or
    submitting the request, so a plain ValueError or a template error is the request's fault (400)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": retry_after})
    if isinstance(exc, ModelLoadError):
        return APIError(503, str(exc), code="model_not_loaded")
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if about_input and (_is_template_error(exc) or isinstance(exc, ValueError)):
        # A chat template's raise_exception() or a bad value is about the request, not the server.
        return APIError(400, str(exc) or type(exc).__name__, code="invalid_request")
    if isinstance(exc, EngineError):  # the engine failed mid-request and says why (its messages carry no prompt)
        logger.error("engine error: %s", exc)
        return APIError(500, f"The engine failed: {exc}")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error ({type(exc).__name__}); see the server log.")


def with_param_names(err: APIError, names: dict[str | None, str]) -> APIError:
    """`err` with its param spelled as the request spelled it. Raise the result straight from the call: an error
    bound to a local of the raising frame holds that frame (and the request in it) in a reference cycle, alive
    until a full collection."""
    err.param = names.get(err.param, err.param)
    return err


def _is_template_error(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        return False
    return isinstance(exc, TemplateError)


def validation_error(exc: ValidationError | RequestValidationError, prefix: str = "") -> APIError:
    """Pydantic errors as one readable 400; `param` is the first offending field's dotted path (after `prefix`).
    The messages are pydantic's short ones, without its internals (a discriminator function's name)."""
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    parts, first_param = [], None
    for err in errors[:5]:
        loc = prefix + ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",) and not _is_tag(p))
        first_param = first_param or loc or None
        msg = _readable(err)
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return APIError(400, "Invalid request: " + "; ".join(parts) + more, param=first_param, code="invalid_value")


_PLAIN_TYPES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_tag(part: Any) -> bool:
    """A union member's name in pydantic's error path ("function-after[...]", "MessageItem", "str"), not a field."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or "-" in part or part in _PLAIN_TYPES)


def _readable(err: dict[str, Any]) -> str:
    kind = err.get("type")
    if kind == "union_tag_not_found":
        return "the item has no recognised type"
    if kind == "union_tag_invalid":
        expected = (err.get("ctx") or {}).get("expected_tags", "")
        return f"unknown type {(err.get('ctx') or {}).get('tag')!r}; expected one of {expected}"
    return str(err.get("msg", "invalid value"))


def install_error_handlers(app: FastAPI,
                           shapes: dict[str, Callable[[APIError], Response]] | None = None) -> None:
    """`shapes`: a path prefix -> the response of an error there (Anthropic's shape under /v1/messages, for the
    router's own 404 and 405 too); elsewhere OpenAI's."""
    def shaped(request: Request, err: APIError) -> Response:
        for prefix, respond in (shapes or {}).items():
            if request.url.path == prefix or request.url.path.startswith(prefix + "/"):
                return respond(err)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> Response:
        return shaped(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path}): no such route."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        err = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        return shaped(request, err)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect) -> Response:
        # the client hung up mid-upload: its own abort, so no 5xx and no traceback (anyone could flood both)
        logger.info("%s %s: client disconnected while sending the body", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return shaped(request, from_engine_error(exc))


def shaped_route(render: Callable[[APIError], Response]) -> type[APIRoute]:
    """A route class whose endpoints answer every error they raise as `render` shapes it (Anthropic's, Ollama's),
    with its status."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except ClientDisconnect:
                    raise
                except Exception as exc:
                    return render(from_engine_error(exc))

            return handle

    return ShapedRoute
