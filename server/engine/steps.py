"""What the engine loop holds instead of a runner: "the runner for the next step". `EagerSteps` always hands out
the eager runner; server.compile.steps.CompiledSteps hands out the compiled one once it is ready, and the eager one
after a compile failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from server.engine.model_runner import InFlightStep, ModelRunner

T = TypeVar("T")


class Steps(Protocol):
    state: str  # one of types.COMPILE_STATES
    compile_prefill: bool  # whether prefill and mixed steps run compiled

    @property
    def runner(self) -> ModelRunner:
        """The runner the next step runs on."""

    def before_step(self, in_flight: InFlightStep | None) -> None:
        """Between two steps: take over from another runner where one is ready (`in_flight`: the step whose
        sampled ids the next one may feed from)."""

    def run(self, call: Callable[[ModelRunner], T]) -> T:
        """`call(runner)`; where it fails to compile, once more on the eager runner, for good."""

    def warm_up(self) -> float:
        """Compile everything before serving; the seconds taken."""

    def compile_in_background(self):
        """Serve eagerly now and compile beside serving; a handle with `join(timeout)`, or None."""


class EagerSteps:
    """Nothing compiled: every step runs on the eager runner."""

    state = "off"
    compile_prefill = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def before_step(self, in_flight: InFlightStep | None) -> None:
        pass

    def run(self, call: Callable[[ModelRunner], T]) -> T:
        return call(self.runner)

    def warm_up(self) -> float:
        return 0.0

    def compile_in_background(self) -> None:
        return None
