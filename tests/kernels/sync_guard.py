"""Catch host syncs on the CPU: the aten ops behind .item(), nonzero, boolean-mask indexing, multinomial, bincount.

`.tolist()` / `.cpu()` on a CPU tensor never reach the dispatcher, so they are not seen here; a CUDA run of
benchmarks/kernels.py checks the same code under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read device data on the host (or size their output from it) and so stall a GPU stream
_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "multinomial", "bincount", "unique", "_unique2"}


class _SyncDetector(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS or name.startswith("_unique"):
            self.seen.append(name)
        if name in ("index", "index_put", "index_put_") and _has_bool_index(args):
            self.seen.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (indices or ()))


@contextlib.contextmanager
def assert_no_host_sync():
    detector = _SyncDetector()
    with detector:
        yield
    assert not detector.seen, f"host-syncing ops were called: {sorted(set(detector.seen))}"
