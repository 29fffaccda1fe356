"""Several models behind one server: each name maps to an engine that loads on its first request, unloads once
idle past its keep-alive, and is evicted least recently used first when a load would pass the memory budget.

An engine is busy while any HTTP request that picked it is still open (`ModelLeaseMiddleware` holds a lease for
the whole response, streams included) or while it still runs requests: eviction and idle unload skip busy ones.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.api.errors import APIError
from server.engine.protocol import ServingEngine

logger = logging.getLogger("mps_serve.api")
_leases: ContextVar[list[ModelSlot] | None] = ContextVar("mps_serve_model_leases", default=None)
REAP_INTERVAL_S = 0.2


@dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...]
    build: Callable[[], ServingEngine]  # blocking: runs on a worker thread
    size_bytes: int  # the estimated resident size, checked against the budget before loading


def gib(num: int | float) -> str:
    return f"{num / 2**30:.2f} GiB"


class ModelSlot:
    def __init__(self, spec: ModelSpec, keep_alive_s: float):
        self.spec = spec
        self.engine: ServingEngine | None = None
        self.leases = 0
        self.last_used = 0.0
        self.keep_alive_s = keep_alive_s  # < 0: never unloaded when idle
        self.expires_at: float | None = None  # wall clock; None: never
        self.loading: asyncio.Future | None = None

    @property
    def idle(self) -> bool:
        if self.leases:
            return False
        if self.engine is None:
            return True
        stats = self.engine.stats()
        return stats.num_running + stats.num_waiting == 0

    def touch(self, keep_alive_s: float | None) -> None:
        if keep_alive_s is not None:
            self.keep_alive_s = keep_alive_s
        self.last_used = time.monotonic()
        self.expires_at = None if self.keep_alive_s < 0 else time.time() + self.keep_alive_s


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], budget_bytes: int, keep_alive_s: float):
        self.slots = [ModelSlot(spec, keep_alive_s) for spec in specs]
        self.budget_bytes = budget_bytes
        self._by_name: dict[str, ModelSlot] = {}
        for slot in self.slots:
            for name in (slot.spec.name, *slot.spec.aliases):
                if name in self._by_name:
                    raise ValueError(f"the model name {name!r} is given twice; each name must pick one model")
                self._by_name[name] = slot
        self._load_lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None

    def names(self) -> list[str]:
        return list(self._by_name)

    def find(self, name: str | None) -> ModelSlot:
        """The slot `name` picks; no name picks the first model."""
        if not name:
            return self.slots[0]
        slot = self._by_name.get(name)
        if slot is None:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {', '.join(self.names())}.",
                           param="model", code="model_not_found")
        return slot

    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> ServingEngine:
        """The engine `name` picks, loaded first if it is not resident (concurrent callers share one load). The
        lease lasts until the current HTTP request ends."""
        slot = self.find(name)
        leases = _leases.get()
        if leases is not None:
            slot.leases += 1
            leases.append(slot)
        try:
            while slot.engine is None:  # loop: an unload may land between the load and this wake-up
                if slot.loading is None:
                    slot.loading = asyncio.ensure_future(self._load(slot))
                await asyncio.shield(slot.loading)
        except BaseException:
            if leases is not None:
                leases.remove(slot)
                self.release(slot)
            raise
        slot.touch(keep_alive_s)
        return slot.engine

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.touch(None)

    def resident_bytes(self) -> int:
        return sum(slot.spec.size_bytes for slot in self.slots if slot.engine is not None)

    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._load_lock:
                await self._make_room(slot)
                logger.info("loading model %s (about %s)", slot.spec.name, gib(slot.spec.size_bytes))
                engine = await asyncio.to_thread(slot.spec.build)
                await engine.start()
                slot.engine = engine
        except APIError:
            raise
        except Exception as exc:  # the next request for the model tries again
            logger.error("could not load the model %s: %s", slot.spec.name, exc)
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise APIError(503, f"The model {slot.spec.name!r} could not be loaded: {text}",
                           code="model_load_failed") from None
        finally:
            slot.loading = None

    async def _make_room(self, slot: ModelSlot) -> None:
        need = slot.spec.size_bytes
        if need > self.budget_bytes:
            raise APIError(503, f"The model {slot.spec.name!r} needs about {gib(need)}, more than the memory budget "
                                f"of {gib(self.budget_bytes)} (--models-memory-gb).", param="model",
                           code="model_too_large")
        while self.resident_bytes() + need > self.budget_bytes:
            idle = [s for s in self.slots if s.engine is not None and s.idle]
            if not idle:
                raise APIError(503, f"The model {slot.spec.name!r} (about {gib(need)}) does not fit beside the "
                                    f"models serving requests now (budget {gib(self.budget_bytes)}); retry shortly.",
                               code="model_memory_busy", headers={"Retry-After": "5"})
            victim = min(idle, key=lambda s: s.last_used)
            logger.info("evicting idle model %s to make room for %s", victim.spec.name, slot.spec.name)
            await self._unload(victim)

    async def _unload(self, slot: ModelSlot) -> None:
        engine, slot.engine, slot.expires_at = slot.engine, None, None
        if engine is not None:
            await engine.shutdown()
            del engine
            await asyncio.to_thread(gc.collect)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.time()
            for slot in self.slots:
                if (slot.engine is not None and slot.loading is None and slot.expires_at is not None
                        and slot.expires_at <= now and slot.idle):
                    async with self._load_lock:
                        if slot.idle:  # a request may have picked it while this waited for the lock
                            logger.info("unloading model %s: idle past its keep-alive", slot.spec.name)
                            await self._unload(slot)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.slots:
            await self._unload(slot)

    def listing(self) -> list[dict[str, Any]]:
        """Per name: its slot's state, for /v1/models, /api/tags, /api/ps and /metrics."""
        return [{"name": name, "slot": slot, "loaded": slot.engine is not None} for name, slot in self._by_name.items()]


class ModelsCollector(Collector):
    """/metrics: each configured model's state, its size against the budget, its expiry and its KV blocks."""

    def __init__(self, registry: ModelRegistry):
        self._registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        loaded = GaugeMetricFamily("mps_serve_models_resident", "1 while the model is loaded", labels=["model"])
        size = GaugeMetricFamily("mps_serve_models_size_bytes", "Estimated resident bytes of the model",
                                 labels=["model"])
        expiry = GaugeMetricFamily("mps_serve_models_expires_at_seconds",
                                   "Unix time of the idle unload; absent: never, or not loaded", labels=["model"])
        blocks = GaugeMetricFamily("mps_serve_models_kv_blocks", "KV cache blocks of a loaded model",
                                   labels=["model", "state"])
        for slot in self._registry.slots:
            name = slot.spec.name
            loaded.add_metric([name], 0 if slot.engine is None else 1)
            size.add_metric([name], slot.spec.size_bytes)
            if slot.engine is not None:
                stats = slot.engine.stats()
                blocks.add_metric([name, "used"], stats.kv_blocks_used)
                blocks.add_metric([name, "free"], stats.kv_blocks_free)
                if slot.expires_at is not None:
                    expiry.add_metric([name], slot.expires_at)
        budget = GaugeMetricFamily("mps_serve_models_memory_budget_bytes", "The memory budget of loaded models",
                                   self._registry.budget_bytes)
        return [loaded, size, expiry, blocks, budget]


class ModelLeaseMiddleware:
    """Holds the leases a request takes on models until its response is sent: an engine that a request picked is
    never evicted while that request runs."""

    def __init__(self, app: Any, registry: ModelRegistry):
        self.app = app
        self.registry = registry

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[ModelSlot] = []
        token = _leases.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _leases.reset(token)
            for slot in leases:
                self.registry.release(slot)
