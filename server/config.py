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
    # compiled decode: "auto" (flex at batch 1 on CUDA for attention-only models where its probe passes, else sdpa)
    # | "sdpa" (gather then SDPA) | "reduce" (gather fused by inductor) | "flex" (FlexAttention at every batch, CUDA)
    decode_attention: str = "auto"
    cuda_graphs: bool | None = None  # None: replay the compiled decode step as CUDA graphs where available
    # one decode graph per (batch, blocks) bucket instead of symbolic sizes (a compile per bucket, only the first
    # block bucket warmed up). An A/B knob for the no-graph mode (MPS-like): H200 session 6, static 49.5% of roofline
    # vs 30.1% symbolic in another call, but equal (1.04 vs 1.03 ms) with 2 layers in one call: unsettled
    decode_static_shapes: bool = False
    # prefill and mixed steps through torch.compile(dynamic=True) too: fewer launches, no per-op dispatch (H200:
    # prefill 1.8x, docs/PERF.md). None: on with the compiled decode step on CUDA for bf16/fp16 attention-only
    # models; off for hybrids (minutes of cold compile), FP8 and on MPS until measured there
    compile_prefill: bool | None = None
    # "combined": one [blocks, block, 2, kv_heads, head_dim] tensor per layer, written by one scatter (H200, Llama
    # batch 1: 4.71 vs 4.75 ms per step end to end, docs/PERF.md session 8); "split": K and V caches apart
    kv_layout: str = "combined"
    # the compiled batch-1 decode step's GEMVs with out_features <= in_features (o_proj, down, ...): "blas"
    # (F.linear) | "reduction" (one inductor reduction kernel, an A/B knob: H200 Llama step 6.09 vs 4.71 ms before
    # its input was stored first; 4.69 vs 4.66 ms since, docs/PERF.md sessions 8-9)
    decode_gemv: str = "blas"
    # the batch-1 decode graph through inductor's GEMM autotuning (A/B knob: alone, one-token qkv / o_proj went
    # 15.4 -> 13.7 / 12.5 -> 10.0 us on the H200, but the whole step went 4.66 -> 5.35 ms; docs/PERF.md session 9)
    decode_autotune_batch1: bool = False
    revision: str | None = None

    def __post_init__(self) -> None:
        for name, choices in ENGINE_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")


# The EngineConfig fields that take one of a few names, checked once when a config is made.
ENGINE_CHOICES = {
    "decode_attention": ("auto", "sdpa", "reduce", "flex"),
    "kv_layout": ("split", "combined"),
    "decode_gemv": ("blas", "reduction"),
}


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
    warmup: bool = True  # compile the decode step before /health turns ready (Engine.warm_up)
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
