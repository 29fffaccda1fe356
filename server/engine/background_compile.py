"""The compiled steps built beside serving. The engine answers on the eager path from the start; a thread of
its own warms up a shadow engine (the same model and caches, the compiled runner, every block the null block:
kv_manager.NullBlocks), and the engine moves its steps to that runner between two steps once it is ready. A
compile that fails leaves the engine on the eager path with one warning, never a crash."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundCompile:
    def __init__(self, warm_up: Callable[[], float], device_name: str):
        self.state = "compiling"
        self.error: str | None = None
        self.seconds: float | None = None
        self._warm_up, self._device_name = warm_up, device_name
        self._thread = threading.Thread(target=self._run, name="mps-serve-compile", daemon=True)

    def start(self) -> None:
        log.info("compiling the decode step in the background; requests are served on the eager path meanwhile")
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the compile to end (tests, benchmarks); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._warm_up()
        except Exception as exc:  # noqa: BLE001 - any failure: say which, and keep serving eagerly
            self.error = describe_failure(exc)
            self.state = "failed"
            log.warning("compiling the decode step failed on %s (%s); requests stay on the eager path, which is "
                        "slower. Please report it on the mps-serve issue tracker with the output of "
                        "`mps-serve selfcheck`.", self._device_name, self.error)
            return
        # What the compile left alive (graphs, dynamo's caches) joins start-up's objects out of the cyclic GC's
        # reach: a full collection walking them would stall every stream.
        gc.freeze()
        self.seconds = time.perf_counter() - start
        self.state = "ready"
        log.info("compiled steps ready after %.1f s; requests move to them", self.seconds)


def describe_failure(exc: BaseException) -> str:
    """The exception and, where torch wrapped another (a backend that raised), the root cause: its type and its
    first line of text, which is what names the failing op."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = "; ".join(line.strip() for line in str(root).splitlines() if line.strip())[:300]
    if root is exc:
        return f"{type(exc).__name__}: {text}"
    return f"{type(exc).__name__}, caused by {type(root).__name__}: {text}"
