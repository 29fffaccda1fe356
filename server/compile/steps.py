"""The compiled steps the engine loop holds (engine.steps.Steps): built lazily at the first call, before serving
(`warm_up`), or beside serving (`compile_in_background`: the eager runner serves while a compile child and a
background thread build the compiled one, which the loop moves to between two steps)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TypeVar

import torch

from server.compile import knobs
from server.compile.background import BackgroundCompile, describe_failure, run_stage
from server.compile.decode_graphs import DecodeGraphs, use_flex_at_batch_1
from server.compile.policy import compiles_decode, wants_compiled_prefill
from server.compile.prefill import CompiledPrefill
from server.compile.runner import CompiledRunner
from server.compile.warmup import WARM_UP_PARAMS, PrefillForms, Stage, prefill_warm_up_runs, warm_up_stages
from server.compile.worker import (
    ChildBeforeLoad,
    cache_holds_every_stage,
    child_spec,
    saved_steps_dir,
    start_compile_child,
)
from server.config import EngineConfig
from server.engine.build import EngineParts
from server.engine.device import serialized_device_work
from server.engine.kv_manager import NullBlocks
from server.engine.model_runner import ModelRunner
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from server.engine.steps import EagerSteps, Steps
from server.kernels.capabilities import REPORT_HINT
from server.models.regions import compiled_layer_regions
from server.models.tracing_shield import shield_from_tracing

log = logging.getLogger(__name__)
T = TypeVar("T")


def child_before_load(config: EngineConfig) -> ChildBeforeLoad:
    """The hook that starts the compile child once the model's tensors exist (`load_pretrained`)."""
    return ChildBeforeLoad(config, start_compile_child)


def build_steps(model, config: EngineConfig, parts: EngineParts, device: torch.device, dtype: torch.dtype,
                max_model_len: int, early: ChildBeforeLoad | None = None, serving: bool = True) -> Steps:
    """The engine's steps: EagerSteps where nothing compiles, else CompiledSteps. `early`: the compile child
    started while the weights loaded; `serving`: the compiled decode step is saved whole as it is traced, and
    loaded from there at a restart (compile.saved: no trace at a warm start)."""
    knobs.tune_generated_kernels(device, knobs.has_packed_weights(model))
    decode = compiles_decode(config, device)
    prefill = wants_compiled_prefill(config, device, decode, parts.state_cache is not None)
    if not decode and not prefill:
        if early is not None and early.child is not None:
            early.child.close()
        return EagerSteps(parts.runner)
    steps = CompiledSteps(model, config, parts, device, dtype, max_model_len, decode, prefill)
    steps.early_child = early.child if early is not None else None
    if serving:
        steps.save_compiled_steps()
    return steps


class CompiledSteps:
    def __init__(self, model, config: EngineConfig, parts: EngineParts, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, compile_decode: bool, compile_prefill: bool):
        shield_from_tracing(model)  # eager steps may run while a background compile traces the model
        compiled_layer_regions(model)  # decoder layers run as their step's plan says: eager, regions or inline
        self.model, self.config, self.parts = model, config, parts
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.eager = parts.runner
        self.compiled = self._compiled_runner(compile_decode, compile_prefill)
        self.runner: ModelRunner = self.compiled  # the runner for the next step
        self.compile_prefill = compile_prefill
        self.background: BackgroundCompile | None = None
        self.early_child = None  # the compile child started while the weights loaded
        self._warmed_up = False
        self._failed = False  # a compile failed while serving: eager from then on

    def _compiled_runner(self, compile_decode: bool, compile_prefill: bool) -> ModelRunner:
        parts, config, model = self.parts, self.config, self.model
        vocab_size = model.args.vocab_size
        if compile_decode:
            flex = use_flex_at_batch_1(self.device, self.dtype, config.cache.block_size, parts.state_cache is None)
            blocks_per_seq = -(-self.max_model_len // config.cache.block_size)
            graphs = DecodeGraphs(model, parts.kv_cache.layers, self.device, config.scheduler.max_num_seqs, blocks_per_seq,
                                  config.compilation.cuda_graphs if config.compilation.cuda_graphs is not None else True,
                                  parts.plans, state_cache=parts.state_cache, flex_at_batch_1=flex)
            runner = CompiledRunner(model, parts.kv_cache, self.device, vocab_size, graphs, parts.state_cache,
                                    parts.plans)
        else:
            runner = ModelRunner(model, parts.kv_cache, self.device, vocab_size, parts.state_cache, parts.plans)
        if compile_prefill:
            states = parts.state_cache.layers if parts.state_cache is not None else []
            caches = list(parts.kv_cache.layers) + [t for layer in states for t in layer]
            runner.forward_steps = CompiledPrefill(model, caches, parts.plans.compiled,
                                                   size_oblivious=parts.state_cache is None)
        return runner

    def _spec(self) -> dict | None:
        return child_spec(self.model, self.config, self.device, self.dtype, self.max_model_len,
                          self.parts.kv_cache.num_blocks - 1)

    def save_compiled_steps(self) -> None:
        graphs, spec = self.compiled.decode_graphs, self._spec()
        if graphs is not None and spec is not None:
            graphs.compiled.save_to(saved_steps_dir(spec))

    @property
    def state(self) -> str:
        """One of types.COMPILE_STATES."""
        if self._failed:
            return "failed"
        if self.background is not None:
            return self.background.state
        return "ready" if self._warmed_up else "lazy"

    def before_step(self, in_flight) -> None:
        if (self.runner is self.eager and self.background is not None and self.background.first_stage_ready
                and not self._failed):
            if isinstance(self.compiled, CompiledRunner):
                self.compiled.feed_from(in_flight)
            self.runner = self.compiled

    def run(self, call: Callable[[ModelRunner], T]) -> T:
        """`call(runner)`; a compiled step that fails to compile here (dynamo or inductor raising before the step
        runs: its first use, or a shape the warm-up did not cover) moves the engine to the eager runner for good,
        with one warning, and the call runs there. (Warm-up stages call their runners directly: their caller
        reports a failure.)"""
        try:
            return call(self.runner)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if self.runner is self.eager:
                raise
            log.warning("compiling the decode step failed on %s (%s); this engine runs eagerly from now on, which "
                        "is slower. %s.", self.device, describe_failure(exc), REPORT_HINT)
            self._failed = True
            self.runner = self.eager
            return call(self.runner)

    def compile_in_background(self) -> BackgroundCompile | None:
        """Serve on the eager path now and warm the compiled steps up on a thread of their own; the loop moves to
        them between two steps, stage by stage (warmup.warm_up_stages), with the same tokens. None when nothing
        is to compile."""
        child, self.early_child = self.early_child, None
        if self.state != "lazy":
            if child is not None:
                child.close()
            return None
        self.runner = self.eager
        spec = self._spec()
        # Where a child filled every stage before, each form only loads: the quicker-to-build forms first would
        # only delay the final ones (inductor's C++ wrapper where no graph replays the step).
        cached = cache_holds_every_stage(spec)
        stages = self.warm_up_stages(beside_serving=not cached)
        if child is not None:
            child.want([what for what, _ in stages])
        elif not cached:
            child = start_compile_child(spec, [what for what, _ in stages])
        self.background = BackgroundCompile(stages, str(self.device), child)
        knobs.run_compiled_calls_during_fx_tracing()  # the steps compiled so far serve beside the compile
        self.background.start()
        return self.background

    def warm_up_stages(self, beside_serving: bool = False) -> list[Stage]:
        warm_prefill = None
        if self.compile_prefill:
            warm_prefill = partial(self._warm_prefill, self.compiled.decode_graphs is None)
        return warm_up_stages(self.compiled, self.parts.kv_manager.num_usable_blocks, warm_prefill, beside_serving)

    def _warm_prefill(self, decode_through_prefill: bool, compiled_forward) -> None:
        """Compile the prefill forms on a shadow runner: the same model and caches, `compiled_forward`, no decode
        graphs (so no write to the ids the serving steps feed from), every block the null block."""
        parts = self.parts
        runner = ModelRunner(self.model, parts.kv_cache, self.device, self.model.args.vocab_size, parts.state_cache,
                             parts.plans)
        runner.forward_steps = (compiled_forward if decode_through_prefill
                                else PrefillForms(compiled_forward, runner.eager_forward))
        scratch = parts.state_cache.scratch_slot if parts.state_cache is not None else None
        null_blocks = NullBlocks(parts.kv_manager.block_size, parts.kv_manager.num_usable_blocks, scratch)
        scheduler = Scheduler(parts.scheduler.config, null_blocks)
        runs = prefill_warm_up_runs(decode_through_prefill, parts.state_cache is not None, self.model.args.vocab_size,
                                    self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        for prompts in runs:
            run_to_completion(scheduler, runner, prompts)

    def warm_up(self) -> float:
        """Compile (and capture) the compiled steps before serving, so that no request waits for them; returns
        the seconds taken. The stages of warmup.warm_up_stages, in order."""
        start = time.perf_counter()
        for what, run in self.warm_up_stages():
            run_stage(what, run, start)
        self._warmed_up = True
        return time.perf_counter() - start


def run_to_completion(scheduler: Scheduler, runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Run warm-up prompts (token ids, WARM_UP_PARAMS) as one batch, each step resolved before the next."""
    for prompt in prompts:
        params = replace(WARM_UP_PARAMS)
        scheduler.add(Request(uuid.uuid4().hex, list(prompt), len(prompt), params, seed=0,
                              max_total_tokens=len(prompt) + params.max_tokens))
    while scheduler.has_work:
        out = scheduler.schedule()
        with serialized_device_work(runner.device):  # takes turns with serving steps where the backend needs it
            step = runner.launch(out)
            scheduler.on_launched(out)
            result = step.resolve()
        scheduler.on_resolved(out, {rid: token.token_id for rid, token in result.sampled.items()})
