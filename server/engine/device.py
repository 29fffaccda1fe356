"""Device and dtype selection, with the reason for each choice (shown by `mps-serve info`)."""

from __future__ import annotations

import platform
import threading
from contextlib import AbstractContextManager, nullcontext

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Backends whose device work two threads must not run at once: torch's MPS backend aborts the process when two
# Python threads run MPS ops together (pytorch/pytorch#197805, seen on torch 2.14 and 2.15 nightlies).
_SERIAL_BACKENDS = {"mps": threading.RLock()}
_NO_LOCK = nullcontext()  # reusable: nothing to hold


def serialized_device_work(device: torch.device) -> AbstractContextManager:
    """Held around each unit of device work that may run beside another thread's (an engine step, a warm-up
    compile run): a process-wide lock where the backend needs one, else nothing."""
    return _SERIAL_BACKENDS.get(device.type, _NO_LOCK)


def mps_unavailable_reason() -> str | None:
    """None when MPS works; otherwise why not, in words a user can act on."""
    mps = getattr(torch.backends, "mps", None)
    if mps is None:
        return f"this torch build ({torch.__version__}) has no MPS backend"
    if mps.is_available():
        return None
    if platform.system() != "Darwin":
        return f"MPS needs macOS on Apple silicon; this machine runs {platform.system()} {platform.machine()}"
    if not mps.is_built():
        return f"this torch build ({torch.__version__}) was not built with MPS support"
    return "macOS reports no usable Metal device (needs macOS 12.3+ on Apple silicon)"


def select_device(name: str = "auto") -> tuple[torch.device, str]:
    """`auto` picks mps, then cuda, then cpu. Returns the device and why it was chosen."""
    mps_reason = mps_unavailable_reason()
    if name == "auto":
        if mps_reason is None:
            return torch.device("mps"), "auto: MPS is available"
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA is available; MPS is not ({mps_reason})"
        return torch.device("cpu"), f"auto: no accelerator (MPS: {mps_reason}; CUDA: not available)"
    if name == "mps" and mps_reason is not None:
        raise ValueError(f"--device mps was requested but MPS is not available: {mps_reason}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but torch sees no CUDA device")
    if name not in ("mps", "cuda", "cpu"):
        raise ValueError(f"unknown device {name!r}; use auto, mps, cuda or cpu")
    return torch.device(name), f"requested --device {name}"


def select_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: the checkpoint's dtype on an accelerator, float32 on the CPU (exact and fast enough there)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use auto, bfloat16, float16 or float32")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV cache may draw from, before the fraction in the config is applied."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(physical // 4, 4 << 30))


def memory_budget_bytes(name: str = "auto") -> int:
    """What several models may take together by default: the recommended working set on a Mac, the card's memory
    on CUDA, physical memory on the CPU."""
    device, _ = select_device(name)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
