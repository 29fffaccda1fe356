"""The resident size of a model in each precision, from its config.json alone: `mps-serve info MODEL` and the
README's "Models and memory" table (benchmarks/model_memory.py) both read it from here.

Each form is the model the engine would build (engine/weights.empty_model) on PyTorch's meta device, nothing
allocated: its bytes are those of the parameters and persistent buffers a load fills (`resident_bytes`), so they
equal `Engine.weight_bytes` of the loaded model. bf16 / fp16: 2 bytes a parameter; FP8: a byte a linear or expert
weight plus a float32 scale a row; int8 / int4: mlx-lm's default recipe (groups of 64, MoE routers at 8 bits, the
embedding and an untied LM head quantized, norms and a layer the group does not divide in the model dtype), which
is also the size of an mlx-community checkpoint of that many bits.

A model fits a Mac (`fits`) when its weights, a bf16 KV cache of KV_TOKENS tokens and OVERHEAD_BYTES
(activations, compiled graphs) fit in what macOS lets the GPU use: about 2/3 of unified memory up to 36 GB, 3/4
above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from server.config import EngineConfig
from server.engine.build import kv_budget_bytes
from server.engine.device import select_device, select_dtype
from server.engine.mlx_checkpoint import checkpoint_spec, mlx_quantization, recipe_spec
from server.engine.model_runner import KVCache
from server.engine.weights import (
    bits_per_weight,
    empty_model,
    read_config,
    resident_bytes,
    resolve_model_path,
    safetensors_files,
)
from server.models.affine_quant import QuantSpec

# form -> empty_model's quantization, in the order a Mac prefers them: the first that fits is the one to serve
# (FP8 before int8: about the same bytes, and its decode kernels are the measured ones).
FORMS = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "int4"}
MAC_MEMORY_GB = (16, 24, 32, 36, 48, 64, 96, 128)
KV_TOKENS = 32768
OVERHEAD_BYTES = 2 * 10**9


@dataclass(frozen=True)
class FormSize:
    weight_bytes: int
    bits_per_weight: float


@dataclass(frozen=True)
class ModelSizes:
    model_type: str
    params: int
    kv_bytes_per_token: int  # bf16 KV cache of one token, all attention layers
    forms: dict[str, FormSize]


def form_size(model: nn.Module) -> FormSize:
    return FormSize(resident_bytes(model), bits_per_weight(model))


def model_sizes(hf_config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> ModelSizes:
    """Every form of FORMS of this config.json (weights in `dtype`)."""
    forms = {}
    for form, quantization in FORMS.items():
        model = empty_model(hf_config, "meta", dtype, quantization)
        forms[form] = form_size(model)
        if quantization is None:
            params = sum(p.numel() for p in model.parameters())
            kv = KVCache.bytes_per_block(model.kv_cache_shapes(), 1, torch.bfloat16)
    return ModelSizes(hf_config["model_type"], params, kv, forms)


def stored_size(hf_config: dict[str, Any], spec: Callable[[nn.Module], QuantSpec],
                dtype: torch.dtype = torch.bfloat16) -> FormSize:
    """An MLX checkpoint as it is stored (engine/mlx_checkpoint's checkpoint_spec or recipe_spec)."""
    return form_size(empty_model(hf_config, "meta", dtype, None, None, spec))


def model_info(model: str, revision: str | None = None) -> list[str]:
    """`mps-serve info MODEL`: a local checkpoint folder, or a Hub repo id of which only config.json is fetched
    (or read from the cache; HF_HUB_OFFLINE honoured). An MLX checkpoint also gets its size as stored: exact from
    the safetensors headers of a local folder, else from config.json's bits and group size with mlx-lm's recipe."""
    model_dir = resolve_model_path(model, revision, config_only=True)
    config = read_config(model_dir)
    table = mlx_quantization(config)
    stored = None
    if table is not None:
        local = any(model_dir.glob("*.safetensors"))
        spec = (checkpoint_spec(config, table, safetensors_files(model_dir)) if local
                else recipe_spec(table["bits"], table["group_size"]))
        how = (f"MLX {table['bits']}-bit, groups of {table['group_size']}"
               f"{'' if local else ' (from config.json: the default recipe)'}")
        stored = (how, stored_size(config, spec))
    return [model, *describe(model_sizes(config), stored)]


def usable_bytes(memory_gb: int) -> float:
    return memory_gb * 1e9 * (2 / 3 if memory_gb <= 36 else 3 / 4)


def fits(weight_bytes: int, kv_bytes_per_token: int, memory_gb: int) -> bool:
    return weight_bytes + kv_bytes_per_token * KV_TOKENS + OVERHEAD_BYTES <= usable_bytes(memory_gb)


def best_form(sizes: ModelSizes, memory_gb: int) -> str | None:
    """The first form of FORMS that fits a Mac of `memory_gb`; None if none does."""
    return next((form for form, size in sizes.forms.items()
                 if fits(size.weight_bytes, sizes.kv_bytes_per_token, memory_gb)), None)


def smallest_mac(weight_bytes: int, kv_bytes_per_token: int) -> int | None:
    return next((gb for gb in MAC_MEMORY_GB if fits(weight_bytes, kv_bytes_per_token, gb)), None)


def human_bytes(num: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"


def describe(sizes: ModelSizes, stored: tuple[str, FormSize] | None = None) -> list[str]:
    """The lines `mps-serve info MODEL` prints."""
    params = f"{sizes.params / 1e9:.2f}B" if sizes.params >= 10**8 else f"{sizes.params / 1e6:.2f}M"
    lines = [f"model_type {sizes.model_type}, {params} parameters; bf16 KV cache "
             f"{human_bytes(sizes.kv_bytes_per_token * 1024)} per 1k tokens",
             f"resident weights (the smallest Mac that fits them with a {KV_TOKENS // 1024}k-token KV cache "
             f"and {OVERHEAD_BYTES // 10**9} GB overhead):"]
    rows = [(form, "--quantize " + form if FORMS[form] else "(no flag)", size) for form, size in sizes.forms.items()]
    if stored is not None:
        rows.append(("as stored", stored[0], stored[1]))
    for form, how, size in rows:
        mac = smallest_mac(size.weight_bytes, sizes.kv_bytes_per_token)
        where = f"fits {mac} GB Macs and up" if mac else f"fits no Mac up to {MAC_MEMORY_GB[-1]} GB"
        lines.append(f"  {form:<9} {human_bytes(size.weight_bytes):>9}  {size.bits_per_weight:5.2f} bits/weight  "
                     f"{where:<28} {how}")
    return lines


def estimated_resident_bytes(config: EngineConfig) -> int:
    """Bytes the model of `config` takes once loaded, from its config.json alone: its weights as they will be held,
    plus its KV cache as configured, else the share of free memory it would take now (at most that). A memory
    budget checks this before loading."""
    load = config.load
    if load.model == "demo":
        from server.engine.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = resolve_model_path(load.model, load.revision, config_only=True)
    hf_config = read_config(model_dir)
    device, _ = select_device(load.device)
    dtype = select_dtype(load.dtype, device, hf_config.get("torch_dtype") or hf_config.get("dtype"))
    table = mlx_quantization(hf_config)
    if table is not None:
        size = stored_size(hf_config, recipe_spec(table["bits"], table["group_size"]), dtype)
    else:
        size = form_size(empty_model(hf_config, "meta", dtype, load.quantization))
    return size.weight_bytes + kv_budget_bytes(config, device, 0)
