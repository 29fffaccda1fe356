"""Frozen configuration dataclasses, loaded from TOML (server/configs/default.toml) and overridden by CLI flags."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    model: str = "demo"
    device: str = "auto"  # auto | mps | cuda | cpu
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    quantization: str | None = None  # None | "fp8"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # token budget per step; also the prefill chunk size
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # paged KV only; None: a fraction of free memory (hybrid states included)
    kv_cache_memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    compile: str = "auto"  # auto (on for mps/cuda, off on cpu) | on | off: the compiled decode step
    # None: replay the compiled decode step as CUDA graphs where the device has them; False runs it as MPS
    # does (every kernel dispatched from the host), for measurement
    cuda_graphs: bool | None = None
    # prefill and mixed steps through torch.compile(dynamic=True) too. None: on with the compiled decode step
    # on CUDA for bf16/fp16 attention-only models, where compiling makes prefill faster; elsewhere eager
    compile_prefill: bool | None = None
    revision: str | None = None
    # one model over several processes started by torchrun (server.engine.distributed): ranks that split every
    # layer (tensor) or hold contiguous layer ranges (pipeline); one of the two at a time
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    distributed_timeout_s: float = 300.0  # a collective of a step waits this long for a hung rank
    cpu_threads: int | None = None  # torch's intra-op threads; None: half the cores, at most 8 (engine/threads.py)

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.quantization in ("none", ""):  # one spelling for "no quantization" from here on
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r}; use none or fp8")
        if min(self.tensor_parallel, self.pipeline_parallel) < 1:
            raise ValueError("tensor_parallel and pipeline_parallel count processes: at least 1")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError("use tensor parallel or pipeline parallel, not both at once")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")


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
    log_level: str = "info"


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def _build(cls: type, values: dict[str, Any], source: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; valid keys are {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def load_config(path: str | Path | None = None, **overrides: dict[str, Any]) -> Config:
    """Read a TOML file with [engine] and [server] tables, then apply overrides (None values are skipped)."""
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
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"{source}: unknown sections {unknown}; use [engine] and [server]")
    built = {}
    for name, cls in sections.items():
        values = dict(data.get(name, {}))
        values.update({k: v for k, v in overrides.get(name, {}).items() if v is not None})
        built[name] = _build(cls, values, source)
    return Config(**built)
