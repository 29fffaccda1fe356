"""Device-to-host copies that overlap the next step's compute.

The engine launches step N+1 while step N's sampled ids travel to the host: the copy runs on a side stream,
into pinned memory where the device is CUDA, and an event marks its end. On CPU (or when the probe finds no
usable streams, or they fail later: capabilities.with_fallback) the copy is made inline and `wait()` returns
at once.
"""

from __future__ import annotations

import torch

from server.kernels import devices
from server.kernels.capabilities import capabilities, with_fallback


class PendingCopy:
    """A device-to-host copy in flight; `wait()` blocks the host until it has landed and returns the host tensor."""

    def __init__(self, host: torch.Tensor, event=None):
        self._host = host
        self._event = event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def _inline_copy(tensor: torch.Tensor) -> PendingCopy:
    """A synchronous copy: the host waits for the device here."""
    return PendingCopy(tensor.detach().to("cpu", copy=True))


class DeviceStreams:
    """One side stream per engine for non-blocking copies to the host (torch.cuda / torch.mps, nothing on CPU)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        probed = capabilities(self.device).streams.ok
        self._module = devices.device_module(self.device) if probed else None
        self._stream = with_fallback(self.device, "streams", lambda: devices.new_stream(self.device), lambda: None,
                                     catch=True) if probed else None
        self.enabled = self._stream is not None

    def copy_to_host(self, tensor: torch.Tensor) -> PendingCopy:
        """Start copying `tensor` (already queued on the current stream) to the host; returns at once."""
        if not self.enabled or devices.is_host(tensor.device):
            return _inline_copy(tensor)
        return with_fallback(self.device, "streams", lambda: self._side_stream_copy(tensor),
                             lambda: _inline_copy(tensor), catch=True)

    def _side_stream_copy(self, tensor: torch.Tensor) -> PendingCopy:
        module = self._module
        self._stream.wait_stream(module.current_stream())  # the copy must follow the kernels that wrote `tensor`
        with module.stream(self._stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=devices.pins_host_memory(self.device))
            host.copy_(tensor, non_blocking=True)
            event = module.Event()
            event.record()
        tensor.record_stream(self._stream)  # the allocator must not reuse `tensor` before the copy reads it
        return PendingCopy(host, event)

    def wait(self, copy: PendingCopy) -> None:
        """Make the current stream's later work wait for `copy` to have read its source (on the device: the
        host does not block). Needed before overwriting a buffer a pending copy reads."""
        if self.enabled and copy._event is not None:
            self._module.current_stream().wait_event(copy._event)
