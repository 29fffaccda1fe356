"""create_app(engine, server_config) -> FastAPI.

The app can start without an engine (run_server loads the model after the socket is up, so /health answers
503 meanwhile); `ServingState.attach` hands it one later. The lifespan starts a given engine and shuts down
whichever engine is attached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.api import (
    anthropic_output,
    anthropic_routes,
    embeddings,
    infill,
    ollama_models,
    ollama_output,
    ollama_routes,
    responses_routes,
)
from server.api.errors import install_error_handlers
from server.api.model_registry import ModelLeaseMiddleware, ModelRegistry
from server.api.middleware import AuthMiddleware, StatusMetricsMiddleware, UnversionedPathMiddleware
from server.api.openapi import install_openapi
from server.api.routes import router
from server.api.state import ServingState
from server.api.timeouts import BodyTimeoutMiddleware
from server.config import ServerConfig
from server.engine.protocol import ServingEngine


def create_app(
    engine: ServingEngine | None, server_config: ServerConfig, *, model_name: str | None = None,
    models: ModelRegistry | None = None,
) -> FastAPI:
    """`model_name` (the MODEL argument) names the served model before the engine exists. `models`: several
    models instead of `engine`, each loaded on its first request."""
    state = ServingState(server_config, model_name)
    if models is not None:
        state.serve_models(models)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            await state.attach(engine)
        if models is not None:
            models.start()
        try:
            yield
        finally:
            if state.engine is not None:
                await state.engine.shutdown()
            if models is not None:
                await models.shutdown()

    app = FastAPI(title="mps-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    install_error_handlers(app, {anthropic_output.ANTHROPIC_ROUTE_PREFIX: anthropic_output.error_response,
                                 ollama_output.OLLAMA_ROUTE_PREFIX: ollama_output.error_response})
    install_openapi(app)
    app.include_router(router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(embeddings.router)
    app.include_router(infill.router)
    app.include_router(ollama_routes.router)
    app.include_router(ollama_models.router)
    if models is not None:
        app.add_middleware(ModelLeaseMiddleware, registry=models)
    app.add_middleware(BodyTimeoutMiddleware, body_timeout_s=server_config.body_timeout_s)
    # add_middleware puts each new one outermost: the body timeout, auth, then CORS around it (so 401s carry
    # CORS headers and preflights pass), then status counting, then the unversioned paths' rewrite around
    # everything.
    if server_config.api_key:
        app.add_middleware(AuthMiddleware, api_key=server_config.api_key)
    if server_config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server_config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    app.add_middleware(StatusMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(UnversionedPathMiddleware)
    return app


def serving_state(app: FastAPI) -> ServingState:
    return app.state.serving
