"""Prometheus metrics in a per-app registry (several apps in one process, e.g. tests, never collide).

Request-level series are updated as requests run; engine gauges (queues, KV blocks, prefix-cache hits) are read
from `engine.stats()` at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.engine.types import COMPILE_STATES, EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST  # matches what generate_latest writes
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineStatsCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineStats | None]):
        self._read_stats = read_stats

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the engine may not exist yet

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        yield GaugeMetricFamily("mps_serve_model_loaded", "1 once the engine is loaded and ready", 0 if stats is None else 1)
        if stats is None:
            return
        gauges = {
            "num_requests_waiting": ("Requests waiting to be scheduled", stats.num_waiting),
            "num_requests_running": ("Requests being generated", stats.num_running),
            "kv_blocks_used": ("KV-cache blocks in use", stats.kv_blocks_used),
            "kv_blocks_free": ("KV-cache blocks free", stats.kv_blocks_free),
            "bits_per_weight": ("Resident bits per model weight (16 bf16, ~8 FP8, ~8.5 int8, ~4.5 int4)",
                                stats.bits_per_weight),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"mps_serve_{name}", doc, value)
        yield CounterMetricFamily(
            "mps_serve_prefix_cache_hit_tokens", "Prompt tokens served from reused KV (memory or disk)",
            stats.prefix_cache_hit_tokens
        )
        tiers = CounterMetricFamily("mps_serve_prefix_cache_tokens",
                                    "Prompt tokens by where their KV came from: memory, disk, or computed (miss)",
                                    labels=["source"])
        tiers.add_metric(["memory"], stats.prefix_cache_hit_tokens - stats.prefix_cache_disk_hit_tokens)
        tiers.add_metric(["disk"], stats.prefix_cache_disk_hit_tokens)
        tiers.add_metric(["miss"], stats.prefix_cache_miss_tokens)
        yield tiers
        yield GaugeMetricFamily("mps_serve_prefix_cache_disk_bytes", "Bytes of the prefix cache's disk tier",
                                stats.prefix_cache_disk_bytes)
        yield CounterMetricFamily("mps_serve_prefix_cache_disk_writes_dropped",
                                  "Evicted KV blocks not written to disk because the write queue was full",
                                  stats.prefix_cache_disk_writes_dropped)
        compile_state = GaugeMetricFamily(
            "mps_serve_compile_state", "1 for the compiled decode step's current state", labels=["state"]
        )
        for name in COMPILE_STATES:
            compile_state.add_metric([name], 1 if stats.compile_state == name else 0)
        yield compile_state


class Metrics:
    def __init__(self, read_stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter(
            "mps_serve_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=reg
        )
        self.requests_finished = Counter(
            "mps_serve_requests_finished",
            "Generation requests (one per choice) by finish reason: stop, length, abort, error",
            ["finish_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter("mps_serve_prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.cached_prompt_tokens = Counter(
            "mps_serve_cached_prompt_tokens", "Prompt tokens of finished requests that reused KV", registry=reg
        )
        self.generation_tokens = Counter("mps_serve_generation_tokens", "Generated tokens", registry=reg)
        self.time_to_first_token = Histogram(
            "mps_serve_time_to_first_token_seconds", "From request arrival to the first token", buckets=_TTFT_BUCKETS, registry=reg
        )
        self.inter_token_latency = Histogram(
            "mps_serve_inter_token_latency_seconds", "Time per generated token after the first", buckets=_ITL_BUCKETS, registry=reg
        )
        self.e2e_latency = Histogram(
            "mps_serve_e2e_request_latency_seconds", "From request arrival to the last token", buckets=_E2E_BUCKETS, registry=reg
        )
        reg.register(_EngineStatsCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
