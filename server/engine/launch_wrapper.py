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
    """`torch.compile(fn, **compile_kwargs)`, built with the C++ wrapper while `cpp_wrapper`. A compile failure
    under the C++ wrapper (a `TorchDynamoException`, raised before the step runs; in a warm-up call, any failure)
    calls `on_fallback()` (undo what the C++ form needed), rebuilds `fn` with the Python wrapper and retries the
    call there, with one warning once that works; any other failure, and any failure of the Python form, reaches
    the caller as is: a step that ran part way may not run again (a hybrid's state is updated in place)."""

    def __init__(self, fn: Callable, name: str, cpp_wrapper: bool, on_fallback: Callable[[], None] | None = None,
                 **compile_kwargs):
        self.fn, self.name, self.on_fallback, self.compile_kwargs = fn, name, on_fallback, compile_kwargs
        self.cpp_wrapper = cpp_wrapper
        self.compiled = torch.compile(fn, options={"cpp_wrapper": True} if cpp_wrapper else None, **compile_kwargs)
        self._cpp_form = self.compiled if cpp_wrapper else None
        self._lock = threading.Lock()  # a serving thread and a background compile may both fail at once
        self._failure: Exception | None = None  # the C++ build's, until the Python form has worked

    def __call__(self, *args, warm_up: bool = False):
        """`warm_up`: a call that may run twice (padding rows and scratch outputs, as warm-up runs): then a failure
        of the C++ form while it runs falls back too, not only a failure to build it."""
        compiled = self.compiled
        if not self.cpp_wrapper:
            return compiled(*args)
        try:
            return compiled(*args)
        except Exception as exc:
            build_failed = isinstance(exc, torch._dynamo.exc.TorchDynamoException)
            if compiled is not self._cpp_form or not (build_failed or warm_up):  # the caller's to report
                raise
            self._use_python_wrapper(compiled, exc)
        out = self.compiled(*args)
        self._warn_once()
        return out

    def _use_python_wrapper(self, failed, exc: Exception) -> None:
        with self._lock:
            if self.compiled is not failed:  # another thread already switched
                return
            self._failure = exc
            if self.on_fallback is not None:
                self.on_fallback()
            self.compiled = torch.compile(self.fn, **self.compile_kwargs)

    def _warn_once(self) -> None:
        with self._lock:
            if self._failure is None:
                return
            log.warning("building %s with inductor's C++ wrapper failed (%s); it launches its kernels from Python "
                        "instead, which costs host time per kernel", self.name, describe_failure(self._failure))
            self._failure, self.cpp_wrapper = None, False
