"""Compiled steps whose kernels are launched from inductor's C++ wrapper where no CUDA graph replays them.

Launched kernel by kernel (MPS, the CPU, CUDA without graphs), a step's host time is the cost of launching each
generated kernel; inductor's default wrapper does that from Python, its C++ wrapper (`cpp_wrapper`, which has CUDA,
CPU and MPS back ends) from one compiled function. The C++ form needs the host's compiler and lacks a few
constructs (a nested compile region among them), so a build that fails falls back to the Python wrapper with one
warning, never to the eager path for that reason alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from server.engine.background_compile import describe_failure

log = logging.getLogger(__name__)


class LaunchCompiled:
    """`torch.compile(fn, **compile_kwargs)`, built with the C++ wrapper where `cpp_wrapper`. A compile failure
    under the C++ wrapper (a `TorchDynamoException`, raised before the step runs; in a warm-up call, any failure)
    calls `on_fallback()` (undo what the C++ form needed), rebuilds `fn` with the Python wrapper and retries the
    call there, with one warning if that retry works; any other failure, and any failure of the Python form, reaches
    the caller as is: a step that ran part way may not run again (a hybrid's state is updated in place)."""

    def __init__(self, fn: Callable, name: str, cpp_wrapper: bool, on_fallback: Callable[[], None] | None = None,
                 **compile_kwargs):
        self.fn, self.name, self.on_fallback, self.compile_kwargs = fn, name, on_fallback, compile_kwargs
        self.compiled = torch.compile(fn, options={"cpp_wrapper": True} if cpp_wrapper else None, **compile_kwargs)
        self._cpp_form = self.compiled if cpp_wrapper else None
        self._lock = threading.Lock()  # a serving thread and a background compile may both fail at once

    @property
    def cpp_wrapper(self) -> bool:
        return self.compiled is self._cpp_form

    def __call__(self, *args, warm_up: bool = False):
        """`warm_up`: a call that may run twice (padding rows and scratch outputs, as warm-up runs): then a failure
        of the C++ form while it runs falls back too, not only a failure to build it."""
        compiled = self.compiled
        if compiled is not self._cpp_form:
            return compiled(*args)
        try:
            return compiled(*args)
        except Exception as exc:
            if not (warm_up or isinstance(exc, torch._dynamo.exc.TorchDynamoException)):
                raise
            failure = exc
        switched = self._use_python_wrapper(compiled)
        out = self.compiled(*args)  # a failure here is the caller's to report, without this warning
        if switched:
            log.warning("building %s with inductor's C++ wrapper failed (%s); it launches its kernels from Python "
                        "instead, which costs host time per kernel", self.name, describe_failure(failure))
        return out

    def _use_python_wrapper(self, failed) -> bool:
        """-> whether this call switched (another thread may have already)."""
        with self._lock:
            if self.compiled is not failed:
                return False
            if self.on_fallback is not None:
                self.on_fallback()
            self.compiled = torch.compile(self.fn, **self.compile_kwargs)
            return True
