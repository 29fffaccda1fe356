"""Benchmark presets (server/configs/presets/*.toml): a [model] table of config.json keys plus optional [bench]
defaults.

The format is described in server/configs/presets/README.md.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

# Package data, so an installed wheel finds the presets as a source checkout does.
PRESET_DIR = resources.files("server") / "configs" / "presets"
BENCH_KEYS = {"prompt_len": int, "num_decode_tokens": int, "batch_sizes": list}


@dataclass(frozen=True)
class Preset:
    name: str
    hf_config: dict[str, Any]  # exactly what a checkpoint's config.json would hold
    bench: dict[str, Any] = field(default_factory=dict)  # prompt_len, num_decode_tokens, batch_sizes


def available_presets() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in PRESET_DIR.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Traversable:
    """A preset name (server/configs/presets/NAME.toml) or a path to a .toml file in the same format."""
    path = Path(name).expanduser()
    if path.suffix == ".toml":
        if not path.is_file():
            raise ValueError(f"preset file {path} does not exist")
        return path
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(available_presets())} (or a path to a .toml)")
    return path


def load_preset(name: str) -> Preset:
    path = preset_path(name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"preset {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"model", "bench"})
    if unknown:
        raise ValueError(f"preset {path}: unknown tables {unknown}; use [model] and [bench]")
    model = data.get("model")
    if not isinstance(model, dict) or "model_type" not in model:
        raise ValueError(f"preset {path} needs a [model] table with model_type (the config.json keys)")
    bench = dict(data.get("bench", {}))
    for key, value in bench.items():
        if key not in BENCH_KEYS:
            raise ValueError(f"preset {path}: unknown [bench] key {key!r}; valid keys are {sorted(BENCH_KEYS)}")
        if not isinstance(value, BENCH_KEYS[key]):
            raise ValueError(f"preset {path}: [bench] {key} must be a {BENCH_KEYS[key].__name__}, got {value!r}")
    return Preset(path.name.removesuffix(".toml"), model, bench)


def with_num_layers(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The config cut to its first `num_layers` decoder layers; per-layer lists (layer_types, ...) are cut with it,
    per-layer index lists (mlp_only_layers, ...) keep the indices that remain."""
    total = int(hf_config["num_hidden_layers"])
    if num_layers > total:
        raise ValueError(f"--num-layers {num_layers}: the preset has {total} layers")
    cut = dict(hf_config, num_hidden_layers=num_layers)
    for key, value in hf_config.items():
        if isinstance(value, list) and len(value) == total and key != "eos_token_id":
            cut[key] = value[:num_layers]
        elif key.endswith("_layers") and isinstance(value, list) and all(isinstance(v, int) for v in value):
            cut[key] = [v for v in value if v < num_layers]
    return cut


def model_args(hf_config: dict[str, Any]):
    """The ModelArgs our model is built from, through the same path as a checkpoint's config.json."""
    from server.models.registry import get_model_module

    return get_model_module(hf_config["model_type"]).ModelArgs.from_hf_config(hf_config)


@dataclass
class Target:
    """What is measured: a preset (random weights) or a checkpoint."""

    name: str
    hf_config: dict[str, Any]
    model_dir: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
