"""Frozen configuration dataclasses, loaded from TOML (server/configs/default.toml) and overridden by CLI flags."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoadConfig:
    """What is loaded, from where, onto which device and in which precision."""

    model: str = "demo"
    revision: str | None = None
    device: str = "auto"  # auto | mps | cuda | cpu
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    quantization: str | None = None  # None | "fp8" | "int8" | "int4"
    cpu_threads: int | None = None  # torch's intra-op threads; None: half the cores, at most 8 (engine/threads.py)

    def __post_init__(self) -> None:
        if self.quantization in ("none", ""):  # one spelling for "no quantization" from here on
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, "fp8", "int8", "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r}; use none, fp8, int8 or int4")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (and the hybrids' states, which draw from the same budget)."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # paged KV only; None: a fraction of free memory (hybrid states included)
    kv_cache_memory_fraction: float = 0.5
    # a disk tier under the prefix cache: evicted KV blocks (and hybrid state snapshots) are written here and read
    # back for a later prompt with that prefix, also after a restart; None: memory only
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float = 16.0  # the disk tier's byte budget per model, least recently used files go first

    def __post_init__(self) -> None:
        if not self.prefix_cache_disk_gb > 0:
            raise ValueError(f"prefix_cache_disk_gb must be above 0, got {self.prefix_cache_disk_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. Plain data: server.engine.scheduler (no torch) takes this type as is."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # token budget per step; also the prefill chunk size
    # None: the model's max_position_embeddings; the scheduler's copy holds the length resolved for the model
    max_model_len: int | None = None


@dataclass(frozen=True)
class CompileConfig:
    compile: str = "auto"  # auto (on for mps/cuda, off on cpu) | on | off: the compiled decode step
    # None: replay the compiled decode step as CUDA graphs where the device has them; False runs it as MPS
    # does (every kernel dispatched from the host), for measurement
    cuda_graphs: bool | None = None
    # prefill and mixed steps through torch.compile(dynamic=True) too. None: on with the compiled decode step
    # on CUDA for bf16/fp16 attention-only models, where compiling makes prefill faster; elsewhere eager
    compile_prefill: bool | None = None

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r} is not one of {', '.join(COMPILE_MODES)}")


@dataclass(frozen=True)
class ParallelConfig:
    # one model over several processes started by torchrun (server.engine.distributed): ranks that split every
    # layer (tensor) or hold contiguous layer ranges (pipeline); one of the two at a time
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    distributed_timeout_s: float = 300.0  # a collective of a step waits this long for a hung rank

    def __post_init__(self) -> None:
        if min(self.tensor_parallel, self.pipeline_parallel) < 1:
            raise ValueError("tensor_parallel and pipeline_parallel count processes: at least 1")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError("use tensor parallel or pipeline parallel, not both at once")


@dataclass(frozen=True)
class EngineConfig:
    """One frozen sub-config per concern. `EngineConfig.from_flat(model=..., max_num_seqs=...)` builds one from
    the flat setting names (the TOML keys of [engine]); each name keeps its name inside its section."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __new__(cls, *args: Any, **kwargs: Any) -> EngineConfig:
        flat = sorted(set(kwargs) & set(FLAT_KEYS))
        if flat:
            places = ", ".join(f"{k} is {FLAT_KEYS[k]}.{k}" for k in flat)
            raise TypeError(f"EngineConfig takes sub-configs ({', '.join(ENGINE_SECTIONS)}); {places}: "
                            "use EngineConfig.from_flat(...) to pass flat settings")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name, cls in ENGINE_SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # as dataclasses.asdict wrote it: EngineConfig(**asdict(config)) round-trips
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise TypeError(f"EngineConfig.{name} must be a {cls.__name__}, got {type(value).__name__}")

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """The defaults with flat settings applied: `EngineConfig.from_flat(model="demo", max_num_seqs=4)`."""
        return cls().replace_flat(**settings)

    def replace_flat(self, **settings: Any) -> EngineConfig:
        """A copy with flat settings (`compile="off"`, `block_size=32`, ...) changed in their sections."""
        unknown = sorted(set(settings) - set(FLAT_KEYS))
        if unknown:
            raise TypeError(f"unknown EngineConfig settings {unknown}; valid: {sorted(FLAT_KEYS)}")
        changes: dict[str, dict[str, Any]] = {}
        for key, value in settings.items():
            changes.setdefault(FLAT_KEYS[key], {})[key] = value
        return dataclasses.replace(
            self, **{name: dataclasses.replace(getattr(self, name), **values) for name, values in changes.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name (the inverse of from_flat)."""
        return {k: v for name in ENGINE_SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()}


ENGINE_SECTIONS: dict[str, type] = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                                    "compilation": CompileConfig, "parallel": ParallelConfig}
# flat setting name -> the EngineConfig section that holds it (under the same name)
FLAT_KEYS: dict[str, str] = {f.name: name for name, cls in ENGINE_SECTIONS.items() for f in dataclasses.fields(cls)}


COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # CORS is off unless origins are given
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 8 * 1024 * 1024
    reasoning_field: str = "reasoning_content"  # or "reasoning"
    keepalive_interval_s: float = 5.0
    shutdown_grace_s: float = 30.0  # on SIGINT/SIGTERM, in-flight streams get this long to finish
    header_timeout_s: float = 30.0  # a connection's request head must be complete this long after it opens
    body_timeout_s: float = 30.0  # longest pause between two reads of a request body (408 after it)
    # compile the decode step beside serving from the start (Engine.compile_in_background); False: on first use
    warmup: bool = True
    # JSON Lines of prompts prefilled into the prefix cache at start-up (server.engine.warm); None: none
    warm_prompts: str | None = None
    log_level: str = "info"
    # several models: how long one stays loaded after its last request (< 0: always), and the bytes all loaded
    # ones may take together (None: the device's memory, engine.device.memory_budget_bytes)
    keep_alive_s: float = 300.0
    models_memory_gb: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """One [[models]] entry: a model the server loads on the first request that names it (or an alias)."""

    model: str
    name: str | None = None  # what requests call it; None: `model` as given
    aliases: tuple[str, ...] = ()
    quantization: str | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelConfig, ...] = ()  # several models; empty: the one of [engine]


def _place(key: str) -> str | None:
    """The table a setting belongs in: [engine.scheduler] for max_num_seqs, [server] for port."""
    if key in FLAT_KEYS:
        return f"[engine.{FLAT_KEYS[key]}]"
    return "[server]" if key in {f.name for f in dataclasses.fields(ServerConfig)} else None


def _unknown(keys: list[str], table: str, valid: list[str], source: str) -> ValueError:
    placed = [f"{k} belongs in {_place(k)}" for k in keys if _place(k) not in (None, table)]
    where = f" ({'; '.join(placed)})" if placed else ""
    return ValueError(f"{source}: unknown keys {keys} in {table}{where}; valid keys are {valid}")


def _build(cls: type, values: dict[str, Any], source: str, table: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise _unknown(unknown, table, sorted(known), source)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def _build_engine(values: dict[str, Any], overrides: dict[str, Any], source: str) -> EngineConfig:
    """[engine] as flat keys (`max_num_seqs = 4`), as tables ([engine.scheduler] `max_num_seqs = 4`), or both;
    flat overrides (CLI flags) win."""
    flat = {k: v for k, v in values.items() if k not in ENGINE_SECTIONS}
    unknown = sorted(set(flat) - set(FLAT_KEYS))
    if unknown:
        raise _unknown(unknown, "[engine]", [*sorted(FLAT_KEYS), *(f"[engine.{n}]" for n in ENGINE_SECTIONS)], source)
    for name in ENGINE_SECTIONS:
        table = values.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [engine] {name} is a table ([engine.{name}]), not a value")
        keys = sorted(f.name for f in dataclasses.fields(ENGINE_SECTIONS[name]))
        unknown = sorted(set(table) - set(keys))
        if unknown:
            raise _unknown(unknown, f"[engine.{name}]", keys, source)
        twice = sorted(set(table) & set(flat))
        if twice:
            raise ValueError(f"{source}: {twice} given twice, in [engine] and in [engine.{name}]")
        flat.update(table)
    flat.update(overrides)
    return EngineConfig.from_flat(**flat)


def load_config(path: str | Path | None = None, **overrides: dict[str, Any]) -> Config:
    """Read a TOML file with [engine] and [server] tables (the engine's settings flat in [engine] or in its
    sub-tables [engine.load], [engine.cache], ...), then apply overrides (None values are skipped)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    sections = {"engine": EngineConfig, "server": ServerConfig}
    models = data.pop("models", [])
    unknown = sorted(set(data) - set(sections))
    if unknown:
        nested = [f"[{n}] is [engine.{n}]" for n in unknown if n in ENGINE_SECTIONS]
        hint = f" ({'; '.join(nested)})" if nested else ""
        raise ValueError(f"{source}: unknown sections {unknown}{hint}; use [engine], [server] and [[models]]")
    built = {}
    for name, cls in sections.items():
        values = dict(data.get(name, {}))
        given = {k: v for k, v in overrides.get(name, {}).items() if v is not None}
        if cls is EngineConfig:
            built[name] = _build_engine(values, given, source)
        else:
            values.update(given)
            built[name] = _build(cls, values, source, f"[{name}]")
    if not isinstance(models, list) or not all(isinstance(m, dict) and "model" in m for m in models):
        raise ValueError(f"{source}: [[models]] entries are tables, each with a `model` key")
    return Config(**built, models=tuple(_build(ModelConfig, m, source, "[[models]]") for m in models))
