"""The compiled steps built beside serving. The engine answers on the eager path from the start; a thread of
its own runs the warm-up stages (warmup.warm_up_stages: the decode step of one sequence first, then the
sampler, larger batches, prefill) on padding rows and the null block (kv_manager.NullBlocks) of the same model and caches.
After the first stage the engine moves to the compiled runner between two steps; what a later stage covers runs
eagerly until that stage ends. A stage that fails leaves what it covers on the eager path with one warning,
never a crash; the stages after it still run, unless it was the first. Given a compile child (compile_child), each
stage first waits for the child to have compiled it into the on-disk caches, so that this process only loads it."""

from __future__ import annotations

import gc
import logging
import re
import sys
import threading
import time

from server.compile.child import CompileChild
from server.compile.warmup import Stage

log = logging.getLogger(__name__)

SERVING_SWITCH_INTERVAL_S = 0.00002  # while compiling beside serving


class BackgroundCompile:
    def __init__(self, stages: list[Stage], device_name: str, child: CompileChild | None = None):
        self.state = "compiling"
        self.first_stage_ready = False  # the engine may move to the compiled runner
        self.error: str | None = None
        self.seconds: float | None = None
        self._stages, self._device_name, self._child = stages, device_name, child
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
        # The compile holds the GIL for long stretches of Python; a serving step waits for it at every
        # re-acquisition, up to the switch interval (5 ms by default) each time.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)
        try:
            self._run_stages(start)
        finally:
            sys.setswitchinterval(switch_interval)
            if self._child is not None:
                self._child.close()

    def _run_stages(self, start: float) -> None:
        for what, run in self._stages:
            if self._child is not None:
                self._child.wait_for(what)  # a read that holds no GIL; then this stage is a cache hit
            try:
                run_stage(what, run, start)
                if self._child is not None:
                    self._child.loaded(what)
            except Exception as exc:  # noqa: BLE001 - any failure: say which, and keep serving eagerly
                self._failed(what, exc)
                if not self.first_stage_ready:
                    return  # nothing compiled: the later stages build on the same step
                continue  # the stages after it cover other work (sampler, batch sizes, prefill)
            self.first_stage_ready = True
        self.first_stage_ready = True  # also when there was no stage
        # What the compile left alive (graphs, dynamo's caches) joins start-up's objects out of the cyclic GC's
        # reach: a full collection walking them would stall every stream.
        gc.freeze()
        self.seconds = time.perf_counter() - start
        if self.state == "compiling":
            self.state = "ready"
        log.info("compiled steps %s after %.1f s", "ready" if self.state == "ready" else "done, some failed",
                 self.seconds)

    def _failed(self, what: str, exc: BaseException) -> None:
        failure = describe_failure(exc)
        self.error = self.error or failure  # the first failure
        self.state = "failed"
        left = "what it covers stays" if self.first_stage_ready else "requests stay"
        log.warning("compiling %s failed on %s (%s); %s on the eager path, which is slower. Please report it "
                    "on the mps-serve issue tracker with the output of `mps-serve selfcheck`.", what,
                    self._device_name, failure, left)


def run_stage(what: str, run, start: float) -> None:
    """Run one warm-up stage and log when it is live."""
    began = time.perf_counter()
    run()
    now = time.perf_counter()
    log.info("compiled %s in %.1f s (%.1f s since the warm-up began); steps use it from now on", what, now - began,
             now - start)


COMPILER_ERROR = re.compile(r"\b(fatal )?error:")


def describe_failure(exc: BaseException) -> str:
    """The exception and, where torch wrapped another (a backend that raised), the root cause: its type and its
    first line of text, which is what names the failing op; and a compiler's first error line where it is further
    on."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    text = "; ".join(lines)[:300]
    # A compiler's message leads with its command line; the line that says what failed comes after it.
    diagnostic = next((line for line in lines if COMPILER_ERROR.search(line)), None)
    if diagnostic is not None and diagnostic[:60] not in text:
        text += f" ... {diagnostic[:300]}"
    if root is exc:
        return f"{type(exc).__name__}: {text}"
    return f"{type(exc).__name__}, caused by {type(root).__name__}: {text}"
