"""Pure-ASGI middleware: unversioned paths, API-key check and per-status request counting (streams stay
unbuffered)."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.anthropic_output import ANTHROPIC_ROUTE_PREFIX
from server.api.anthropic_output import error_response as anthropic_error_response
from server.api.errors import APIError
from server.api.metrics import Metrics
from server.api.ollama_output import OLLAMA_ROUTE_PREFIX
from server.api.ollama_output import error_response as ollama_error_response

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
             "/v1/models", "/infill", "/health", "/metrics", "/api/chat", "/api/generate", "/api/embed",
             "/api/embeddings", "/api/tags", "/api/show", "/api/ps", "/api/version", "/api/pull", "/api/delete")
PROTECTED = ("/v1", "/infill", OLLAMA_ROUTE_PREFIX + "/")  # what --api-key guards


# Clients configured with the server's root as their base URL (no /v1) send these paths.
UNVERSIONED = ("/chat/completions", "/completions", "/models")


class UnversionedPathMiddleware:
    """Serves `/chat/completions`, `/completions`, `/models` and `/models/{id}` as their /v1 routes, before any
    other middleware sees the path: the API key and the metrics apply to them as to /v1."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and any(path == p or path.startswith(p + "/") for p in UNVERSIONED):
            scope = dict(scope, path="/v1" + path, raw_path=b"/v1" + scope.get("raw_path", path.encode()))
        await self.app(scope, receive, send)


class AuthMiddleware:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic clients) on /v1/*, /infill and /api/*,
    compared in constant time; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED) and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            error = self._check(headers.get("authorization"), headers.get("x-api-key"))
            if error is not None:
                response = _error_response(scope["path"], error)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, header: str | None, api_key: str | None) -> APIError | None:
        auth = {"WWW-Authenticate": "Bearer"}
        if api_key is not None and not header:
            header = f"Bearer {api_key}"
        if not header:
            return APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                            code="invalid_api_key", headers=auth)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers=auth)
        return None


def _error_response(path: str, error: APIError):
    if path.startswith(ANTHROPIC_ROUTE_PREFIX):
        return anthropic_error_response(error)
    if path.startswith(OLLAMA_ROUTE_PREFIX + "/"):
        return ollama_error_response(error)
    return error.response()


class StatusMetricsMiddleware:
    """Counts every HTTP response by endpoint and status code (unknown paths are one "other" label)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            path = scope["path"]
            endpoint = next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")
            self._metrics.http_requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
