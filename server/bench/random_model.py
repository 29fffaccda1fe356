"""Real shapes, random weights, built directly on the device; and the same weights handed to transformers.

Every tensor's values are a pure function of (seed, our parameter name, shape, dtype, device): a generator on
the device is seeded from the name, so nothing is ever materialized on the CPU, and the transformers peer can
regenerate exactly the same numbers later (after our model was freed) by mapping each of its parameter names
onto ours through the engine's own loading table (`WeightLoader`: q/k/v rows of qkv_proj, gate/up rows of
gate_up_proj, fused experts by name).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from server.engine import device as device_mod
from server.engine.mlx_checkpoint import AffineLoader
from server.engine.weights import WeightLoader, empty_model, persistent_tensors
from server.models.affine_quant import affine_modules
from server.models.parallel import Layout, locate

INIT_STD = 0.02


def init_value(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int, std: float = INIT_STD
) -> torch.Tensor:
    """N(0, std) for weights; 1 + N(0, std) for norm weights (1-D tensors whose name mentions `norm`). Never zeros."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    sample_dtype = dtype if dtype.is_floating_point and dtype.itemsize >= 2 else torch.float32
    value = torch.randn(tuple(shape), generator=generator, device=device, dtype=sample_dtype).mul_(std)
    if len(shape) == 1 and "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        value.add_(1.0)
    return value.to(dtype)


@torch.no_grad()
def build_random_model(
    hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0, quantization: str | None = None,
    layout: Layout | None = None,
) -> nn.Module:
    """Our model with random weights, filled on `device` one tensor at a time through the serving loader. Each
    tensor is generated under its unquantized name and shape, so with `quantization="fp8"` it is quantized as it
    is loaded and the peak memory is the FP8 model plus one tensor: an 80B model fits one GPU in FP8 though not
    in bf16. Under a parallel `layout`, this rank's part: the same values as one device's model, sliced."""
    model = empty_model(hf_config, device, dtype, quantization, layout)
    loader = WeightLoader(model)
    affine = AffineLoader(model) if affine_modules(model) else None  # int4 / int8: quantized as they load
    for name, meta in persistent_tensors(empty_model(hf_config, "meta", dtype)).items():
        where = locate(model, name)
        if not meta.is_floating_point() or where is None:
            continue
        local_name, shard = where
        if loader.resolve(local_name) is None and (affine is None or affine.resolve(local_name) is None):
            raise ValueError(f"{name} has no place in the {quantization or dtype} model")
        value = init_value(name, meta.shape, meta.dtype, device, seed)
        value = value if shard is None else shard.take(value)
        if affine is None or not affine.take(local_name, value):
            loader.load(local_name, value)
    return model


def load_random(hf_config: dict[str, Any], seed: int, max_model_len: int, config, layout: Layout):
    """A parallel engine's loader (server.engine.distributed.BuildSpec) of a preset: this rank's part of the
    random model -> (model, no tokenizer, device, dtype, max_model_len)."""
    device, _ = device_mod.select_device(config.load.device)
    dtype = device_mod.select_dtype(config.load.dtype, device, None)
    return build_random_model(hf_config, device, dtype, seed, config.load.quantization, layout), None, device, dtype, \
        max_model_len


class OurWeights:
    """Regenerates our random weights under transformers' names (no copy of our model needs to exist)."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int):
        self.meta_model = empty_model(hf_config, "meta", dtype)
        self.loader = WeightLoader(self.meta_model)
        self.tensors = persistent_tensors(self.meta_model)
        self.device, self.seed = device, seed
        self._cached: tuple[str, torch.Tensor] | None = None  # q, k, v rows of one qkv_proj: generate it once

    def value_for(self, hf_name: str, shape: Sequence[int]) -> torch.Tensor | None:
        """The value of transformers' tensor `hf_name` of `shape` (a full tensor or a row block of one of ours);
        None if it has no counterpart in our model."""
        name = self.meta_model.sanitize(hf_name)
        if name is None:
            return None
        target = self.loader.resolve(name, shape)
        if target is None:
            return self._full(name) if name in self.tensors else None
        param_name, index, _key = target
        full = self._full(param_name)
        return full[index] if index is not None else full

    def _full(self, name: str) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            meta = self.tensors[name]
            self._cached = (name, init_value(name, meta.shape, meta.dtype, self.device, self.seed))
        return self._cached[1]


@torch.no_grad()
def copy_our_weights_into(hf_model: nn.Module, hf_config: dict[str, Any], dtype: torch.dtype, seed: int) -> list[str]:
    """Overwrite every parameter (and persistent floating buffer) of a transformers model with our random
    weights for the same config. Raises when a parameter has no counterpart (the transfer would not be exact);
    returns the names of buffers left as transformers computed them."""
    device = next(hf_model.parameters()).device
    ours = OurWeights(hf_config, dtype, device, seed)
    params = {id(p) for p in hf_model.parameters()}
    kept, missing = [], []
    for name, tensor in persistent_tensors(hf_model).items():
        value = ours.value_for(name, tensor.shape) if tensor.is_floating_point() else None
        if value is None:
            (missing if id(tensor) in params else kept).append(name)
            continue
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"transformers' {name} has shape {list(tensor.shape)}, ours {list(value.shape)}")
        tensor.copy_(value)
    if missing:
        raise ValueError(f"transformers parameters with no counterpart in our model: {missing[:5]}")
    return kept
