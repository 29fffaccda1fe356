"""run_server(config, engine_factory) -> exit code: uvicorn with a model that loads after the socket is up.

Order: bind the socket (/health answers 503) -> build the engine in a background thread -> start its loop on the
server's event loop -> /health 200, and "Application startup complete" is logged (uvicorn's own line, logged once
the socket is up, is left out); a load failure is instead one error line, and the exit status 1. SIGINT/SIGTERM: stop accepting, let in-flight requests finish; after the
grace period abort the rest (their clients get a shutdown error event), shut the engine down, return 0.
A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from server.api.app import create_app, serving_state
from server.api.model_registry import ModelRegistry
from server.api.state import ServingState
from server.api.timeouts import header_deadline_protocol
from server.config import Config, ServerConfig
from server.engine.protocol import ServingEngine

logger = logging.getLogger("mps_serve.api")
DEFAULT_SHUTDOWN_GRACE_S = 30.0
_BACKSTOP_S = 5.0  # after the grace period, how long aborted streams get to end before uvicorn cancels them


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState, grace_s: float,
                 on_started: Callable[[asyncio.AbstractEventLoop], None]):
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn's version re-raises the signal after shutdown, which would kill the process instead of
        # letting run_server return 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started(asyncio.get_running_loop())

    async def shutdown(self, sockets: list | None = None) -> None:
        self._state.draining = True
        if self._state.engine is not None:  # else nothing was served (the model did not load)
            logger.info("shutting down: %d request(s) in flight, grace period %.0fs", len(self._state.active),
                        self._grace_s)
        aborter = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets=sockets)
        finally:
            aborter.cancel()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self._grace_s)
        await self._state.abort_all()


def uvicorn_config(app: Any, server_config: ServerConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for `app`: address and log level from the config, the request-head deadline."""
    settings = {"host": server_config.host, "port": server_config.port, "log_level": server_config.log_level.lower(),
                "lifespan": "on", "http": header_deadline_protocol(server_config.header_timeout_s), **overrides}
    return uvicorn.Config(app, **settings)


def run_server(
    config: Config,
    engine_factory: Callable[[], ServingEngine] | None,
    *,
    shutdown_grace_s: float | None = None,
    models: ModelRegistry | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean shutdown, 1 when the model failed to load. With `models`
    (several) instead of `engine_factory`, nothing loads before the first request that names a model."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=config.server.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    grace_s = shutdown_grace_s
    if grace_s is None:
        grace_s = getattr(config.server, "shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S)
    app = create_app(None, config.server, model_name=config.engine.load.model, models=models)
    state = serving_state(app)
    failures: list[BaseException] = []

    startup_log = _StartupLog()

    def load_engine(loop: asyncio.AbstractEventLoop) -> None:
        try:
            engine = engine_factory()
            if server.should_exit:
                return  # asked to stop while loading: nothing was started
            asyncio.run_coroutine_threadsafe(state.attach(engine), loop).result()
            logger.info("Application startup complete: the model is loaded and serving.")
        except Exception as exc:
            startup_log.failed = True
            logger.error("could not load the model: %s", _one_line(exc))
            failures.append(exc)
            server.should_exit = True

    def start_loading(loop: asyncio.AbstractEventLoop) -> None:
        if models is not None:
            logger.info("Application startup complete: serving %s, each loaded on its first request.",
                        ", ".join(models.names()))
            return
        threading.Thread(target=load_engine, args=(loop,), name="mps-serve-load", daemon=True).start()

    uv_config = uvicorn_config(app, config.server, timeout_graceful_shutdown=grace_s + _BACKSTOP_S)
    server = _Server(uv_config, state, grace_s, start_loading)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(startup_log)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when the port cannot be bound
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        uvicorn_log.removeFilter(startup_log)
    return 1 if failures or not server.started else 0


class _StartupLog(logging.Filter):
    """uvicorn says "Application startup complete" once the socket is up, before the model loads (/health answers 503
    meanwhile): run_server says it once the model serves instead. After a load failure uvicorn's shutdown lines are
    left out, so that the error is the last line."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Application startup complete"):
            return False
        return not (self.failed and record.levelno < logging.WARNING)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
