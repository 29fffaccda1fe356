"""Serving starts at once on the eager path while the compiled steps are built beside it; requests move to them
once ready, with the same tokens; a compile that fails leaves the engine eager with one warning."""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch._inductor.compile_fx
import torch.fx._symbolic_trace

from server.compile.background import SERVING_SWITCH_INTERVAL_S, describe_failure
from server.compile.decode_graphs import DecodeGraphs
from server.compile.runner import CompiledRunner
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.helpers import ENGINE_KW, random_ids

pytestmark = [pytest.mark.compile, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                     reason="inductor needs a C compiler on the CPU")]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HYBRIDS = ("qwen3_5_moe_text", "lfm2_moe")


def eager_tokens(path, prompts):
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    assert eager.compile_state == "off" and eager.compile_in_background() is None
    return [o.token_ids for o in eager.generate(prompts, PARAMS)]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_5_moe_text", "lfm2_moe"])
def test_requests_are_served_while_compiling_then_move_to_the_compiled_step(arch, tiny_checkpoint, hybrid_checkpoint,
                                                                          monkeypatch):
    """The hybrid's warm-up runs read and write only the scratch state slot, so the sequences served meanwhile
    keep theirs."""
    path, _ = (hybrid_checkpoint if arch in HYBRIDS else tiny_checkpoint)(arch)
    prompts = [random_ids(n, n + 1) for n in (5, 13)]
    expected = eager_tokens(path, prompts)
    gate = threading.Event()
    warm = DecodeGraphs.warm
    monkeypatch.setattr(DecodeGraphs, "warm", lambda self, *args: gate.wait(120) and warm(self, *args))  # held
    if arch in HYBRIDS:  # its C++ form, minutes to build on the CPU, is test_hybrid_parity's
        monkeypatch.setattr(CompiledRunner, "build_cpp_forms", lambda self: None)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert engine.compile_state == "lazy"
    background = engine.compile_in_background()
    assert engine.compile_state == "compiling" and engine.stats().compile_state == "compiling"
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected  # served while compiling
    assert engine.runner.decode_graphs is None
    # A request in flight while the compiled steps become ready: the first compiled decode step feeds from it.
    requests = [engine.inputs.make_request(p, replace(PARAMS)) for p in prompts]
    for request in requests:
        engine.add_request(request)
    engine.step()
    engine.step()
    gate.set()
    assert background.join(300) and engine.compile_state == "ready", background.error
    while engine.has_unfinished:
        engine.step()
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.shapes_run
    assert [r.output_token_ids for r in requests] == expected
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.kv_manager.num_used_blocks == 0 and engine.stats().compile_state == "ready"


def test_one_sequence_moves_to_the_compiled_step_while_larger_batches_still_compile(tiny_checkpoint, monkeypatch):
    """The decode step of one sequence compiles first and is used as soon as it is ready: a single user gets the
    compiled speed while the larger batches compile; a batch of two runs eagerly until its stage ends."""
    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 7) for n in (6, 11)]
    expected = eager_tokens(path, prompts)
    gate, warm, run = threading.Event(), DecodeGraphs.warm, DecodeGraphs.run

    def held_warm(self, batch_sizes, max_gather_blocks):
        if batch_sizes[0] > 1:
            gate.wait(120)
        return warm(self, batch_sizes, max_gather_blocks)

    served = []  # the padded batch of each compiled step the engine ran
    monkeypatch.setattr(DecodeGraphs, "warm", held_warm)
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, packed_host, before_write=None: served.append(
        packed_host.shape[0]) or run(self, packed_host, before_write))
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    default_switch_interval = sys.getswitchinterval()
    background = engine.compile_in_background()
    for _ in range(1200):
        if background.first_stage_ready or background.state == "failed":
            break
        time.sleep(0.1)
    assert background.first_stage_ready and engine.compile_state == "compiling", background.error
    switch_interval = sys.getswitchinterval()  # short while compiling: serving steps wait less for the GIL
    assert switch_interval == pytest.approx(SERVING_SWITCH_INTERVAL_S) and switch_interval < default_switch_interval
    assert [o.token_ids for o in engine.generate(prompts[:1], PARAMS)] == expected[:1]
    assert served and set(served) == {1}  # every decode step of the single sequence ran compiled
    # from inductor's Python wrapper: its C++ wrapper, slower to build, launches the step after the last stage
    assert engine.runner.decode_graphs.kernel_launch == "python wrapper"
    served.clear()
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert 2 not in served  # the two sequences decoded together eagerly
    gate.set()
    assert background.join(300) and engine.compile_state == "ready", background.error
    assert sys.getswitchinterval() == default_switch_interval
    assert engine.runner.decode_graphs.kernel_launch == "c++ wrapper" and engine.runner._sample.cpp_wrapper
    with torch.compiler.set_stance("fail_on_recompile"):  # built as served: no compile on the serving thread
        assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert 2 in served and engine.kv_manager.num_used_blocks == 0


class RecordingLock:
    """An RLock that records which threads held it."""

    def __init__(self):
        self._lock, self.threads = threading.RLock(), set()

    def __enter__(self):
        self._lock.acquire()
        self.threads.add(threading.current_thread().name)

    def __exit__(self, *exc):
        self._lock.release()


def test_where_the_backend_needs_it_the_compile_and_the_steps_take_turns(tiny_checkpoint, monkeypatch):
    """MPS aborts the process when two threads run device work at once: there every engine step and every
    warm-up compile run hold one lock (here the CPU is made such a backend), and the tokens stay the eager ones."""
    import server.engine.device as device_mod

    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 11) for n in (5, 10)]
    expected = eager_tokens(path, prompts)
    lock = RecordingLock()
    monkeypatch.setattr(device_mod, "_SERIAL_BACKENDS", {"cpu": lock})
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    background = engine.compile_in_background()
    while not background.join(0):
        assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert background.state == "ready", background.error
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert {"MainThread", "mps-serve-compile"} <= lock.threads  # steps and compile runs both take it


def test_a_failing_compile_leaves_the_engine_eager_with_one_warning(tiny_checkpoint, monkeypatch, caplog):
    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 2) for n in (4, 9)]
    expected = eager_tokens(path, prompts)

    def broken(*args, **kwargs):  # inductor failing to build a kernel for this device
        raise RuntimeError("no kernel for this op on this device")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    with caplog.at_level(logging.WARNING):
        assert engine.compile_in_background().join(120)
    assert engine.compile_state == "failed"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no kernel for this op on this device" in warnings[0].getMessage()
    assert "eager path" in warnings[0].getMessage()
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.runner.decode_graphs is None and engine.kv_manager.num_used_blocks == 0


def record_graph_batches(monkeypatch) -> list[int]:
    """The batch size of every decode step served through the compiled step's graphs, appended as they run."""
    served, run = [], DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, packed_host, before_write=None: served.append(
        packed_host.shape[0]) or run(self, packed_host, before_write))
    return served


def compile_collecting_warnings(engine: Engine, caplog):
    """Run the background compile to its end -> (its BackgroundCompile, the warnings it logged)."""
    with caplog.at_level(logging.WARNING):
        background = engine.compile_in_background()
        assert background.join(300)
    return background, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_later_stage_that_fails_leaves_only_what_it_covers_eager(tiny_checkpoint, monkeypatch, caplog):
    """The decode step of one sequence compiled, the larger batches' stage failed: one warning naming that stage,
    single sequences stay compiled, batches run eagerly, the tokens are the eager ones."""
    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 3) for n in (7, 12)]
    expected = eager_tokens(path, prompts)
    warm = DecodeGraphs.warm

    def failing_warm(self, batch_sizes, max_gather_blocks):
        if batch_sizes[0] > 1:
            raise RuntimeError("no kernel for this batch on this device")
        return warm(self, batch_sizes, max_gather_blocks)

    monkeypatch.setattr(DecodeGraphs, "warm", failing_warm)
    served = record_graph_batches(monkeypatch)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    _, warnings = compile_collecting_warnings(engine, caplog)
    assert len(warnings) == 1 and "the decode step of 2-8 sequences failed" in warnings[0], warnings
    assert "no kernel for this batch" in warnings[0] and "what it covers stays on the eager path" in warnings[0]
    assert engine.compile_state == "failed"
    assert [o.token_ids for o in engine.generate(prompts[:1], PARAMS)] == expected[:1] and set(served) == {1}
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected and 2 not in served


def test_the_stages_after_a_failed_one_still_compile(tiny_checkpoint, monkeypatch, caplog):
    """The sampler's stage failed (inductor could not build its kernels): one warning naming it, sampled rows stay
    eager, and the larger batches' stage after it still compiles and serves."""
    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 5) for n in (5, 11)]
    expected = eager_tokens(path, prompts)

    def broken(self):
        raise RuntimeError("no scan kernel for this vocabulary")

    monkeypatch.setattr(CompiledRunner, "warm_sampler", broken)
    served = record_graph_batches(monkeypatch)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    background, warnings = compile_collecting_warnings(engine, caplog)
    assert len(warnings) == 1 and "compiling the sampler failed" in warnings[0], warnings
    assert engine.compile_state == "failed" and "no scan kernel" in background.error
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected and 2 in served
    assert not engine.runner.sampler_ready and engine.runner.decode_graphs.ready_num_seqs > 2


def test_the_serving_engine_answers_while_compiling_and_logs_its_start_up(tiny_checkpoint, monkeypatch, caplog):
    """AsyncEngine (what `serve` runs): the compile starts beside serving, the first request is answered while it
    runs, and the log has the start-up phases: weights loaded, compile started, first token served."""
    import asyncio

    from server.engine.async_engine import AsyncEngine

    path, _ = tiny_checkpoint("llama")
    gate = threading.Event()
    warm = DecodeGraphs.warm
    monkeypatch.setattr(DecodeGraphs, "warm", lambda self, *args: gate.wait(120) and warm(self, *args))
    prompt = random_ids(6, 3)
    expected = eager_tokens(path, [prompt])[0]

    async def serve_one() -> list[int]:
        engine = AsyncEngine(Engine.from_pretrained(str(path), **ENGINE_KW, compile="on"))
        await engine.start()
        background = engine.compile_in_background()
        tokens = [t async for delta in engine.stream(prompt, replace(PARAMS)) for t in delta.token_ids]
        assert engine.engine.compile_state == "compiling"
        gate.set()
        assert background.join(300) and engine.engine.compile_state == "ready", background.error
        await engine.shutdown()
        return tokens

    with caplog.at_level(logging.INFO):
        assert asyncio.run(serve_one()) == expected
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("weights loaded in ") for m in messages)
    assert any(m.startswith("compiling the decode step in the background") for m in messages)
    assert any(m.startswith("first token served ") and m.endswith("(compile: compiling)") for m in messages)


def test_compiled_steps_run_while_another_thread_traces_with_fx(tiny_checkpoint, monkeypatch):
    """FX's tracing flag is process-wide, and a compile on the background thread sets it while it traces (inductor's
    pattern matcher): a compiled decode step served meanwhile on the engine's thread still runs."""
    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + 3) for n in (7, 12)]
    expected = eager_tokens(path, prompts)
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert engine.compile_in_background().join(300) and engine.compile_state == "ready"
    monkeypatch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)  # as mid-trace on another thread
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.runner.decode_graphs.shapes_run


def test_a_compilers_failure_is_described_by_its_error_line_not_its_command_line():
    command = "g++ " + " ".join(f"-I/include/path/{i}" for i in range(60)) + " main.cpp"
    output = "main.cpp: In function 'void run()':\nmain.cpp:42:7: error: 'aoti_flex' was not declared in this scope"
    compile_error = RuntimeError(f"C++ compile error\n\nCommand:\n{command}\n\nOutput:\n{output}")
    wrapped = RuntimeError("backend failed")
    wrapped.__cause__ = compile_error
    described = describe_failure(wrapped)
    assert described.startswith("RuntimeError, caused by RuntimeError: C++ compile error; Command:")
    assert described.endswith("main.cpp:42:7: error: 'aoti_flex' was not declared in this scope")
    # A short message that already shows its error line is not repeated.
    assert describe_failure(RuntimeError("x.cpp:1: error: bad")) == "RuntimeError: x.cpp:1: error: bad"
