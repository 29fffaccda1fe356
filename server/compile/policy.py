"""What compiles on a device: the decode step, and prefill and mixed steps."""

from __future__ import annotations

import torch

from server.config import EngineConfig


def compiles_decode(config: EngineConfig, device: torch.device) -> bool:
    """Whether the decode step is compiled: by default on GPU backends, not on the CPU (tests switch it on)."""
    return config.compilation.compile == "on" or (config.compilation.compile == "auto" and device.type != "cpu")


def wants_compiled_prefill(config: EngineConfig, device: torch.device, decode_compiled: bool, hybrid: bool) -> bool:
    """An explicit setting wins. None: on where compiling makes prefill faster: with the compiled decode step, on
    CUDA, attention-only models (a hybrid's dynamic-shape prefill graph takes minutes to compile cold)."""
    if config.compilation.compile_prefill is not None:
        return config.compilation.compile_prefill
    return decode_compiled and device.type == "cuda" and not hybrid
