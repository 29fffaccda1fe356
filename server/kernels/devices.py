"""Facts about a device's kind that plumbing asks by name (streams, host copies, collectives, synchronizing). With
the probe (capabilities) and the plan builder (plan), the only place in kernels and models that reads a device's
type: which form of an op a step runs is the step plan's to say."""

from __future__ import annotations

from types import ModuleType

import torch


def is_host(device: torch.device | str) -> bool:
    """Whether tensors on `device` are in host memory (the CPU): nothing to wait for, nothing to copy back."""
    return torch.device(device).type == "cpu"


def device_module(device: torch.device | str) -> ModuleType:
    """torch.cuda, torch.mps or torch.cpu: the streams, events and synchronize of `device`'s kind."""
    return getattr(torch, torch.device(device).type)


def new_stream(device: torch.device | str):
    """A side stream on `device` (torch.mps.Stream takes no device: there is one)."""
    device = torch.device(device)
    module = device_module(device)
    return module.Stream(device=device) if device.type == "cuda" else module.Stream()


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether copies between the host and `device` go through pinned host memory (CUDA)."""
    return torch.device(device).type == "cuda"


def collectives_through_host(device: torch.device | str) -> bool:
    """Whether torch.distributed's collectives take this device's tensors through the host: Gloo (the backend
    between Macs) reads CPU tensors only."""
    return torch.device(device).type == "mps"


def tunes_generated_kernels(device: torch.device | str) -> bool:
    """Whether inductor's generated kernels have a block-size tuner here (Triton on CUDA; not Metal or C++)."""
    return torch.device(device).type == "cuda"


def has_cudnn_attention(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"
