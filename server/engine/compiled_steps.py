"""The engine's compiled steps: built lazily at the first call, before serving (`warm_up`), or beside serving
(`compile_in_background`: the eager runner serves while a compile child and a background thread build the
compiled one, which the engine moves to between two steps)."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from server.engine.background_compile import BackgroundCompile, run_stage
from server.engine.build import EngineParts
from server.engine.compile_worker import (
    ChildBeforeLoad,
    cache_holds_every_stage,
    child_spec,
    saved_steps_dir,
    start_compile_child,
)
from server.engine.kv_manager import NullBlocks
from server.engine.model_runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.types import StepFailedError
from server.engine.warmup import WARM_UP_PARAMS, PrefillForms, Stage, prefill_warm_up_runs, warm_up_stages
from server.kernels import compat


def child_before_load(config) -> ChildBeforeLoad:
    """The hook that starts the compile child once the model's tensors exist (`load_pretrained`)."""
    return ChildBeforeLoad(config, start_compile_child)


class CompiledSteps:
    """Mixed into `Engine`: the state it keeps is the engine's (`_background`, `_compiled_runner`,
    `_early_child`, `_warmed_up`, `_compile_failed`)."""

    def save_compiled_steps(self) -> None:
        """Save the compiled decode step whole under the compile cache as it is traced, and load it from there at
        a restart (saved_compile: no trace at a warm start). Called for serving engines (from_config, from_model);
        the compile child saves it on its fakes through compile_worker.twin_stages."""
        graphs = self.runner.decode_graphs
        spec = child_spec(self.model, self.config, self.device, self.dtype, self.max_model_len,
                          self.kv_cache.num_blocks - 1)
        if graphs is not None and spec is not None:
            graphs.compiled.save_to(saved_steps_dir(spec))

    @property
    def compile_state(self) -> str:
        """One of types.COMPILE_STATES."""
        if self._compile_failed:
            return "failed"
        if self._background is not None:
            return self._background.state
        if self.runner.decode_graphs is None and not self.compile_prefill:
            return "off"
        return "ready" if self._warmed_up else "lazy"

    def compile_in_background(self) -> BackgroundCompile | None:
        """Serve on the eager path now and warm the compiled steps up on a thread of their own; the engine moves
        to them between two steps, stage by stage (warmup.warm_up_stages), with the same tokens. None when
        nothing is to compile."""
        child, self._early_child = self._early_child, None
        if self.compile_state != "lazy":
            if child is not None:
                child.close()
            return None
        compiled = self._compiled_runner = self.runner
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.vocab_size, None, self.state_cache,
                                  compiled.plans)
        spec = child_spec(self.model, self.config, self.device, self.dtype, self.max_model_len,
                          self.kv_cache.num_blocks - 1)
        # Where a child filled every stage before, each form only loads: the quicker-to-build forms first would
        # only delay the final ones (inductor's C++ wrapper where no graph replays the step).
        cached = cache_holds_every_stage(spec)
        stages = self._warm_up_stages(compiled, beside_serving=not cached)
        if child is not None:
            child.want([what for what, _ in stages])
        elif not cached:
            child = start_compile_child(spec, [what for what, _ in stages])
        self._background = BackgroundCompile(stages, str(self.device), child)
        compat.run_compiled_calls_during_fx_tracing()  # the steps compiled so far serve beside the compile
        self._background.start()
        return self._background

    def _warm_up_stages(self, runner: ModelRunner, beside_serving: bool = False) -> list[Stage]:
        warm_prefill = partial(self._warm_prefill, runner.decode_graphs is None) if self.compile_prefill else None
        return warm_up_stages(runner, self.kv_manager.num_usable_blocks, warm_prefill, beside_serving)

    def _warm_prefill(self, decode_through_prefill: bool, compiled_forward) -> None:
        """Compile the prefill forms through a shadow engine: the same model and caches, `compiled_forward`, no
        decode graphs (so no write to the ids the serving steps feed from), every block the null block."""
        runner = ModelRunner(self.model, self.kv_cache, self.device, self.vocab_size, None, self.state_cache,
                             self.runner.plans)
        runner.forward_steps = (compiled_forward if decode_through_prefill
                                else PrefillForms(compiled_forward, runner.eager_forward))
        scratch = self.state_cache.scratch_slot if self.state_cache is not None else None
        null_blocks = NullBlocks(self.kv_manager.block_size, self.kv_manager.num_usable_blocks, scratch)
        parts = EngineParts(self.kv_cache, self.state_cache, null_blocks, Scheduler(self.scheduler.config, null_blocks),
                            runner, True)
        shadow = type(self)(self.model, None, self.config, self.device, self.dtype, self.max_model_len, self.model_name,
                        parts)
        runs = prefill_warm_up_runs(decode_through_prefill, self.state_cache is not None, self.vocab_size,
                                    self.config.max_num_batched_tokens, self.max_model_len)
        shadow._warming_up = True
        try:
            for prompts in runs:
                shadow.run_to_completion([shadow.make_request(p, replace(WARM_UP_PARAMS)) for p in prompts])
        except StepFailedError as exc:  # the caller reports the compile failure itself, not the lost step
            raise (exc.__cause__ or exc) from None

    def _move_to_compiled_runner(self) -> None:
        """Between two steps: the compiled decode step feeds the ids of the step in flight from its own buffer."""
        compiled, in_flight = self._compiled_runner, self._in_flight
        if in_flight is not None and in_flight.token_ids is not None and compiled.decode_graphs is not None:
            compiled.decode_graphs.last_token_ids[: in_flight.token_ids.shape[0]].copy_(in_flight.token_ids)
        self.runner = compiled

    def warm_up(self) -> float:
        """Compile (and capture) the compiled steps before serving, so that no request waits for them; returns
        the seconds taken. The stages of warmup.warm_up_stages, in order. A no-op when nothing is compiled (the
        CPU default)."""
        if self.runner.decode_graphs is None and not self.compile_prefill:
            return 0.0
        start = time.perf_counter()
        for what, run in self._warm_up_stages(self.runner):
            run_stage(what, run, start)
        self._warmed_up = True
        return time.perf_counter() - start
