"""Compiled steps whose kernels are launched from inductor's C++ wrapper where no CUDA graph replays them.

Launched kernel by kernel (MPS, the CPU, CUDA without graphs), a step's host time is the cost of launching each
generated kernel; inductor's default wrapper does that from Python, its C++ wrapper (`cpp_wrapper`, which has CUDA,
CPU and MPS back ends) from one compiled function. The C++ form needs the host's compiler, lacks a few constructs
(a call of a compiled region among them: its step's regions are inlined after tracing, or traced inline where
torch lacks that pass) and is slower to build, so it is a second form: built first where nothing serves
meanwhile, built after the Python form where the engine serves while it compiles, and never the reason a step
falls back to the eager path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from server.compile.background import describe_failure
from server.compile.saved import DynamicDims, SavedCompile
from server.compile import knobs

log = logging.getLogger(__name__)

WarmUp = Callable[[Callable], None]  # runs warm-up calls (inputs safe to run twice) of the step it is given


class LaunchCompiled:
    """`torch.compile(python_fn, **compile_kwargs)` (a SavedCompile) and, given `cpp_fn` (the same step, traced as
    the C++ wrapper can build it), its C++-wrapper form, which launches the step from the start. A failure to build
    the C++ form (a `TorchDynamoException`, raised before the step runs; in a warm-up call, any failure) moves the
    step to the Python form for good, with one warning; any other failure, and any failure of the Python form,
    reaches the caller as is: a step that ran part way may not run again (a hybrid's state is updated in place).

    Beside serving, `python_first()` makes the Python form (quicker to build) launch the step until
    `build_cpp_form` has built the C++ one on warm-up calls."""

    def __init__(self, python_fn: Callable, name: str, cpp_fn: Callable | None = None,
                 dynamic_dims: DynamicDims | None = None, **compile_kwargs):
        self.name = name
        dims = dynamic_dims or {}
        self._python_form = SavedCompile(python_fn, name, dims, **compile_kwargs)
        self._cpp_form = None
        if cpp_fn is not None:
            self._cpp_form = SavedCompile(cpp_fn, f"{name} (C++ wrapper)", dims, **knobs.cpp_wrapper_compile_kwargs(),
                                          **compile_kwargs)
        self.compiled = self._cpp_form or self._python_form
        self._lock = threading.Lock()  # a serving thread and a background compile may both fail at once

    def save_to(self, store: Path | None, save_only: bool = False) -> None:
        """Each form saves what it traces under `store` and loads it at a restart (SavedCompile.save_to)."""
        self._python_form.save_to(store / "python" if store else None, save_only)
        if self._cpp_form is not None:
            self._cpp_form.save_to(store / "cpp" if store else None, save_only)

    @property
    def cpp_wrapper(self) -> bool:
        return self.compiled is self._cpp_form

    def python_first(self) -> None:
        """Launch from the Python form until `build_cpp_form` has built the C++ form."""
        self.compiled = self._python_form

    def build_cpp_form(self, run_warm_up: WarmUp) -> None:
        """Build the C++ form by `run_warm_up(form)` and launch the step from it from then on; where that fails, the
        Python form stays, with one warning. A no-op without a C++ form or once it launches the step."""
        cpp_form = self._cpp_form
        if cpp_form is None or self.compiled is cpp_form:
            return
        try:
            run_warm_up(lambda *args, warm_up=True: cpp_form(*args))
        except Exception as exc:  # noqa: BLE001 - any failure: the Python form serves on
            self._cpp_form = None
            self._warn(exc)
            return
        self.compiled = cpp_form

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
        switched = self._use_python_form(compiled)
        out = self.compiled(*args)  # a failure here is the caller's to report, without this warning
        if switched:
            self._warn(failure)
        return out

    def _use_python_form(self, failed) -> bool:
        """-> whether this call switched (another thread may have already)."""
        with self._lock:
            if self.compiled is not failed:
                return False
            self._cpp_form, self.compiled = None, self._python_form
            return True

    def _warn(self, failure: BaseException) -> None:
        log.warning("building %s with inductor's C++ wrapper failed (%s); it launches its kernels from Python "
                    "instead, which costs host time per kernel", self.name, describe_failure(failure))
