"""A compiled step that a restart loads instead of tracing it again.

torch's AOT precompile (`aot_compile`) saves what dynamo makes of a function (the code that calls the graph and
the guards that say when it applies) together with inductor's output (the graph's kernels) in one file. A warm
start then skips dynamo's trace, which it repeats otherwise: inductor's own caches only skip the compile after
it. Each saved entry is one traced graph with its guards, as dynamo's own cache keeps them (a batch of one, a
symbolic batch): a call runs the first entry whose guards pass and traces a new one, saved beside the others,
where none does.

Tracing for the store runs inductor's lowering again where inductor's FX graph cache would have skipped it, so
the compile child saves the entries (`save_only`: traced on its fakes, never run), and the serving process loads
them once the child is done with the stage, rather than tracing itself. Without a store (`save_to(None)`),
where torch does not save compiled code soundly (`saves_compiles`), or once tracing an entry this way failed (a
note in the store keeps later starts from trying again), the step is plain `torch.compile`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from server.kernels import compat

log = logging.getLogger(__name__)

# Taken at import: the compile child replaces torch.compile with its cache filler, whose output does not save.
_compile = torch.compile

DynamicDims = dict[int, tuple[int, ...]]  # argument index -> its dimensions compiled as symbolic sizes
UNSAVEABLE = "unsaveable.txt"  # left in a store where tracing to save failed: the reason


class SavedCompile:
    """`torch.compile(fn, **compile_kwargs)`, whose traced entries persist in the store `save_to` names.

    `fn` is a function, or a bound method of a plain-data object (its guards name it, so it must pickle: no
    locks, no threads). `dynamic_dims` are marked with `maybe_mark_dynamic` on the inputs a trace sees, so that
    one entry serves every size of those dimensions (torch still specializes a size of 1)."""

    def __init__(self, fn: Callable, name: str, dynamic_dims: DynamicDims, **compile_kwargs):
        self.name, self.dynamic_dims = name, dynamic_dims
        self._compiled = torch.compile(fn, **compile_kwargs)
        options = {**compile_kwargs.get("options", {}), "guard_filter_fn": saved_guards}
        saved_kwargs = dict(compile_kwargs, options=options)
        with _aot_compile_enabled():
            self._saved_form = _compile(fn, **saved_kwargs)
        self._owner = (fn.__self__,) if inspect.ismethod(fn) else ()  # the saved code takes it as an argument
        self._globals = inspect.unwrap(getattr(fn, "__func__", fn)).__globals__
        self._store: Path | None = None
        self._entries: list | None = None  # loaded at the first call
        self._loaded: set[Path] = set()
        self._save_only = False
        self._lock = threading.Lock()  # a serving thread and a background compile may both trace

    @property
    def store(self) -> Path | None:
        return self._store

    def save_to(self, store: Path | None, save_only: bool = False) -> None:
        """Save traced entries in `store` and load those saved there (None: plain torch.compile). `save_only`:
        a call traces and saves an entry for its inputs where none is saved, and runs nothing (the inputs may
        be fakes)."""
        if store is not None and not saves_compiles():
            log.info("torch %s does not save compiled code reliably: %s is traced at each start", torch.__version__,
                     self.name)
            store = None
        if store is not None and (store / UNSAVEABLE).exists():
            log.info("%s is traced at each start: saving it failed before (%s)", self.name,
                     (store / UNSAVEABLE).read_text().strip())
            store = None
        self._store = store
        self._entries, self._loaded, self._save_only = None, set(), save_only

    def __call__(self, *args):
        if self._store is None:
            self._mark(args)
            return self._compiled(*args)
        entry = self._entry_for(args)
        if entry is None:  # tracing for the store failed: plain torch.compile from now on
            return self(*args)
        return None if self._save_only else entry(*self._owner, *args)

    def _entry_for(self, args: tuple):
        if self._entries is None:
            with self._lock:
                if self._entries is None:
                    self._load_new()
        entry = self._matching(self._entries, args)
        if entry is not None:
            return entry
        with self._lock:  # another thread, or the compile child, may have saved one meanwhile
            return self._matching(self._load_new(), args) or self._trace(args)

    def _matching(self, entries: list, args: tuple):
        return next((entry for entry in entries if entry.guard_check(*self._owner, *args)), None)

    def _load_new(self) -> list:
        """Load the entries saved in the store since the last look; -> every entry."""
        entries = list(self._entries or [])
        for path in sorted(set(self._store.glob("*.pt2")) - self._loaded):
            self._loaded.add(path)
            try:
                with path.open("rb") as file:
                    entry = torch.compiler.load_compiled_function(file, f_globals=self._globals)
            except Exception as exc:  # noqa: BLE001 - a bad entry is traced again, never a failed start
                log.warning("a saved compile of %s (%s) does not load (%s); it is traced again", self.name, path,
                            _describe(exc))
                path.unlink(missing_ok=True)
                continue
            entry.disable_guard_check()  # _entry_for checks the guards, once per call
            entries.append(entry)
            log.info("loaded a saved compile of %s", self.name)
        self._entries = entries
        return entries

    def _trace(self, args: tuple):
        """Trace and compile an entry for these inputs, then save it; None where that fails (with one warning)."""
        start = time.perf_counter()
        try:
            entry = self._saved_form.aot_compile((self._marked_copies(args), {}))
        except Exception as exc:  # noqa: BLE001 - the plain compile serves, and reports a failure of its own
            log.warning("compiling %s to be saved for restarts failed (%s); it is compiled at each start instead",
                        self.name, _describe(exc))
            with contextlib.suppress(OSError):  # restarts of this same engine and torch do not try again
                self._store.mkdir(parents=True, exist_ok=True)
                (self._store / UNSAVEABLE).write_text(_describe(exc) + "\n")
            self._store = None
            return None
        entry.disable_guard_check()
        self._entries = [*self._entries, entry]
        path = self._store / f"{uuid.uuid4().hex}.pt2"
        try:
            self._store.mkdir(parents=True, exist_ok=True)
            entry.save_compiled_function(str(path))
            self._loaded.add(path)
            log.info("saved a compile of %s, traced in %.1f s", self.name, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - it serves from memory; a restart traces it again
            log.warning("saving the compiled %s failed (%s); a restart compiles it again", self.name, _describe(exc))
        return entry

    def _marked_copies(self, args: tuple) -> tuple:
        """The inputs a trace sees: copies, so that the caller's tensors carry no marks (a saved entry's guards
        expect none), their dynamic dimensions marked."""
        copies = list(args)
        for index in self.dynamic_dims:
            copies[index] = args[index].clone()
        self._mark(copies)
        return tuple(copies)

    def _mark(self, args) -> None:
        for index, dims in self.dynamic_dims.items():
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[index], dim)


def _describe(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def saves_compiles() -> bool:
    """Whether torch saves and loads compiled code soundly: from 2.13. Before, an entry traced on fakes (the compile
    child's) does not load (an error on CUDA, a crash on the CPU)."""
    return compat.torch_version() >= (2, 13) and hasattr(torch.compiler, "load_compiled_function")


def _aot_compile_enabled():
    """torch.compile gives its output `aot_compile` only under this flag, which is off by default before 2.13."""
    config = torch._dynamo.config
    return config.patch(enable_aot_compile=True) if hasattr(config, "enable_aot_compile") else nullcontext()


def saved_guards(guards) -> list[bool]:
    """Which of an entry's guards it keeps: not those on globals or of kinds torch cannot save (aot_compile's own
    choice), nor those on the model's parameters and buffers. The store's key fixes their shapes and dtypes,
    their type differs where the compile child traced on fakes, and each guard costs host time at every call."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [not (guard.is_global or guard.guard_type in unsaveable or "._parameters[" in guard.name
                 or "._buffers[" in guard.name) for guard in guards]
