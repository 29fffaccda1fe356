"""The serving side of the compile in a child process (compile.twin has the child's side).

A compile holds the GIL for long stretches of Python, so beside serving in one process it slows every step served
meanwhile (the eager path to a tenth of its rate). The child builds the engine's twin on fake tensors, runs the
same warm-up stages and so fills inductor's on-disk caches; the serving process waits for each stage's report
(a blocking read, which holds no GIL) and then runs the stage itself, a cache hit: the warm-start cost instead of
the cold one. Whatever the child does not fill (a stage it skips or fails, or all of them when it dies) the
serving process compiles itself, as before: the child only ever saves time.

Protocol, one JSON object per line. On the child's stdin (kept open: the child ends when it closes) the spec, and
later `{"stages": [what, ...]}` where the child started before the engine existed: the stages the serving process
runs (the child skips the others). On its stdout `{"stages": [what, ...]}` (the stages it will fill, in the
serving process's order), one `{"stage": what, "ok": bool, "seconds": s, "error": text}` per stage, and
`{"failed": text}` if it cannot go on.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class CompileChild:
    def __init__(self, process: subprocess.Popen, log_path: Path, count_misses: Callable[[], int],
                 asked: list[str] | None = None):
        self._process, self.log_path, self._count_misses = process, log_path, count_misses
        self._misses_before: int | None = None  # the cache misses before loading a stage the child filled
        self._announced: list[str] | None = None  # the stages the child fills, once it said so
        self._asked = asked  # the stages it was asked for, where its spec names them
        self._reported: dict[str, dict] = {}
        self._ended = False  # no more reports come
        self._closed = False  # ended by us: what it reported is no longer waited for
        self._lock = threading.Lock()  # one reader of the child's stdout at a time

    @classmethod
    def start(cls, spec: dict, argv: list[str], env: dict[str, str], log_path: Path,
              count_misses: Callable[[], int]) -> CompileChild:
        """Start the child `argv` (its stderr to `log_path`) and hand it `spec`. `count_misses()`: this process's
        compile-cache misses so far."""
        with open(log_path, "wb") as stderr:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                                       text=True)
        process.stdin.write(json.dumps(spec) + "\n")
        process.stdin.flush()
        log.info("compiling in a child process (pid %d, log %s); this one loads what it compiled", process.pid,
                 log_path)
        return cls(process, log_path, count_misses, spec.get("stages"))

    def want(self, stages: list[str]) -> None:
        """Tell a child started before the engine existed which stages this process runs: it skips the others."""
        try:
            self._process.stdin.write(json.dumps({"stages": stages}) + "\n")
            self._process.stdin.flush()
        except (OSError, ValueError):  # it ended already (or was ended): nothing to tell
            pass

    def wait_for(self, what: str) -> bool:
        """Block until the child has filled the caches for stage `what` -> whether it did. False at once for a
        stage the child does not fill (also before it announced its stages, for one it was not asked for); False
        when it failed the stage or ended first."""
        if self._asked is not None and what not in self._asked:
            self._misses_before = None
            return False
        with self._lock:
            while not self._ended and (self._announced is None or what in self._announced) \
                    and what not in self._reported:
                self._read_one()
            report = None if self._closed else self._reported.get(what)
        filled = bool(report and report.get("ok"))
        self._misses_before = self._count_misses() if filled else None
        return filled

    def loaded(self, what: str) -> None:
        """After this process ran stage `what`: where the child had filled it and this process compiled anyway
        (cache misses), the child's graphs differ from ours, and waiting for it only costs time: end it."""
        if self._misses_before is None:
            return
        misses = self._count_misses() - self._misses_before
        if misses > 0:
            log.info("loading %s missed the compile cache %d time(s) after the compile child filled it; this process"
                     " compiles the rest itself", what, misses)
            self.close()

    def close(self) -> None:
        """End the child, whether or not it is done."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            pipe.close()
        self._ended = self._closed = True

    def _read_one(self) -> None:
        line = self._process.stdout.readline()
        if not line:
            self._ended = True
            if self._process.wait() != 0:
                log.info("the compile child ended with exit status %d (its log: %s); this process compiles what "
                         "it did not", self._process.returncode, self.log_path)
            return
        try:
            message = json.loads(line)
        except ValueError:
            return  # not ours: the child's stdout is its protocol only, but a stray print must not stop us
        if "stages" in message:
            self._announced = list(message["stages"])
            if not self._announced:  # it had started before the engine could look for them
                log.info("the compile cache holds this model's steps: loading them in this process")
        elif "stage" in message:
            self._reported[message["stage"]] = message
            if message.get("ok"):
                log.info("the compile child filled the cache for %s in %.1f s", message["stage"], message["seconds"])
            else:
                log.info("the compile child could not compile %s (%s); this process compiles it", message["stage"],
                         message.get("error"))
        elif "failed" in message:
            log.info("the compile child failed (%s; its log: %s); this process compiles instead",
                     message["failed"], self.log_path)
