"""What one app instance holds: its config, the engine once loaded, metrics, and the requests in flight."""

from __future__ import annotations

import datetime
import logging
import time
from contextvars import ContextVar
from importlib import metadata

from server.api.errors import APIError
from server.api.generation import Generation
from server.api.metrics import Metrics
from server.api.model_registry import ModelRegistry, ModelsCollector
from server.api.offload import Offloader
from server.config import ServerConfig
from server.engine.protocol import ServingEngine
from server.engine.types import EngineStats

logger = logging.getLogger("mps_serve.api")
_requested_model: ContextVar[str | None] = ContextVar("mps_serve_requested_model", default=None)


def _version() -> str:
    try:
        return metadata.version("mps-serve")
    except metadata.PackageNotFoundError:
        return "dev"


class ServingState:
    def __init__(self, config: ServerConfig, model_name: str | None = None):
        self.config = config
        self.engine: ServingEngine | None = None
        self.draining = False
        self.created = int(time.time())
        self.created_at = datetime.datetime.fromtimestamp(self.created, datetime.UTC).isoformat().replace("+00:00", "Z")
        self.system_fingerprint = f"fp_mps_serve_{_version()}"
        self.active: set[Generation] = set()
        self.metrics = Metrics(self.read_stats)
        self.offloader = Offloader()
        self._model_name = model_name
        self.models: ModelRegistry | None = None  # several models: picked by each request's `model`

    def serve_models(self, registry: ModelRegistry) -> None:
        self.models = registry
        self.metrics.registry.register(ModelsCollector(registry))

    @property
    def served_model_name(self) -> str:
        """--served-model-name, else the model argument (path or Hub id), else what the engine loaded; with
        several models, the name the current request picked its model by."""
        if self.models is not None:
            return _requested_model.get() or self.models.slots[0].spec.name
        if self.config.served_model_name:
            return self.config.served_model_name
        if self._model_name:
            return self._model_name
        return self.engine.model_name if self.engine is not None else "unknown"

    @property
    def model_ids(self) -> list[str]:
        if self.models is not None:
            return self.models.names()
        names = [self.served_model_name]
        names += [alias for alias in self.config.model_aliases if alias not in names]
        return names

    @property
    def is_ready(self) -> bool:
        if self.models is not None:
            return True
        return self.engine is not None and self.engine.is_ready

    def ready_engine(self) -> ServingEngine:
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="server_shutdown")
        if self.models is None and not self.is_ready:
            raise APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                           headers={"Retry-After": "5"})
        return self.engine

    async def engine_for(self, name: str | None, keep_alive_s: float | None = None) -> ServingEngine:
        """The engine a request's `model` picks: with one model, that one whatever the name; with several, the
        named one, loaded first when it is not resident (404 for a name not served)."""
        if self.models is None:
            return self.ready_engine()
        self.ready_engine()  # a draining server refuses first
        engine = await self.models.acquire(name, keep_alive_s)
        _requested_model.set(name or self.models.slots[0].spec.name)
        return engine

    def read_stats(self) -> EngineStats | None:
        if self.engine is None or not self.engine.is_ready:
            return None
        try:
            return self.engine.stats()
        except Exception:  # a scrape must never fail because of the engine
            logger.exception("engine.stats() failed")
            return None

    async def attach(self, engine: ServingEngine) -> None:
        """Start the engine's loop on this event loop, then route requests to it."""
        await engine.start()
        self.engine = engine
        logger.info("engine ready: serving %s (max_model_len=%d)", self.served_model_name, engine.max_model_len)

    async def abort_all(self) -> None:
        """Shutdown's grace period is over: stop what still runs; the clients get a shutdown error."""
        if self.active:
            logger.warning("aborting %d in-flight request(s) for shutdown", len(self.active))
        for generation in list(self.active):
            await generation.abort(server=True)
