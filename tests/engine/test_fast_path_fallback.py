"""The engine on a fast path that fails at run time: one warning, and the same greedy tokens as an engine that
takes the reference path from the start."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from server.compile import background as background_compile
from server.engine.types import SamplingParams
from server.kernels import compat, streams
from server.kernels.capabilities import Probe, capabilities
from tests.helpers import make_engine, needs_cpu_scaled_mm, random_ids, replan

CPU = torch.device("cpu")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [random_ids(n, n) for n in (5, 11)]


@pytest.fixture(autouse=True)
def fresh_failures():
    failures = capabilities(CPU).runtime_failures
    failures.clear()
    yield
    failures.clear()


def broken(*args, **kwargs):
    raise RuntimeError("no kernel for this shape on this device")


def _tokens(path, **kw) -> list[list[int]]:
    return [out.token_ids for out in make_engine(path, **kw).generate(PROMPTS, PARAMS)]


def _reference_off(monkeypatch, name: str):
    """Make the probe answer no for `name`: the engine then takes the reference path from its first step."""
    if name == "grouped_mm":
        replan(monkeypatch, {"grouped_mm": False}, {"grouped_mm": False})
    elif name == "fp8_rowwise":
        off = {"fp8_rowwise": False, "fp8_rowwise_bias": False}
        replan(monkeypatch, off, off)


def _break(monkeypatch, name: str):
    if name == "grouped_mm":
        monkeypatch.setattr(compat, "grouped_mm", broken)
    elif name == "fp8_rowwise":
        monkeypatch.setattr(compat, "scaled_mm_rowwise", broken)
    elif name == "fp8_grouped":  # planned to have one, the CPU's scaled_grouped_mm fails for real
        replan(monkeypatch, {"fp8_grouped": True}, {"fp8_grouped": True})
    elif name == "streams":
        probed = dataclasses.replace(capabilities(CPU), streams=Probe(True, "told so by the test"))
        monkeypatch.setattr(streams, "capabilities", lambda device: probed)
        monkeypatch.setattr(torch.cpu, "Stream", broken)


@pytest.mark.parametrize("name, arch, quantization", [
    ("grouped_mm", "qwen3_moe", None),
    pytest.param("fp8_rowwise", "llama", "fp8", marks=needs_cpu_scaled_mm),
    ("fp8_grouped", "qwen3_moe", "fp8"),
    ("streams", "qwen3", None),
])
def test_a_failing_fast_path_gives_the_reference_tokens_with_one_warning(tiny_checkpoint, monkeypatch, caplog, name,
                                                                          arch, quantization):
    path, _ = tiny_checkpoint(arch)
    with monkeypatch.context() as patch:
        _reference_off(patch, name)
        expected = _tokens(path, quantization=quantization)
    _break(monkeypatch, name)
    with caplog.at_level(logging.WARNING):
        got = _tokens(path, quantization=quantization)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"the {name} fast path failed on cpu" in warnings[0], warnings
    assert "mps-serve selfcheck" in warnings[0]
    assert got == expected
    assert list(capabilities(CPU).runtime_failures) == [name]


@pytest.mark.compile
def test_a_lazy_compile_that_fails_runs_eagerly_with_one_warning(tiny_checkpoint, monkeypatch, caplog):
    """Without the background compile (the Python API, `generate`, `serve --no-warmup`), the compiled step is
    built at its first use: a failure there moves the engine to the eager path instead of failing the request.
    The warm-up still raises, for its caller to report."""
    import torch._inductor.compile_fx

    path, _ = tiny_checkpoint("qwen3")
    expected = _tokens(path, compile="off")
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    engine = make_engine(path, compile="on")
    assert engine.compile_state == "lazy"
    with caplog.at_level(logging.WARNING):
        got = [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]
        assert [out.token_ids for out in engine.generate(PROMPTS, PARAMS)] == got
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compiling the decode step failed on cpu" in warnings[0], warnings
    assert "no kernel for this shape on this device" in warnings[0] and "mps-serve selfcheck" in warnings[0]
    assert got == expected
    assert engine.compile_state == "failed" and engine.runner.decode_graphs is None
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        make_engine(path, compile="on").warm_up()


@pytest.mark.compile
@pytest.mark.parametrize("beside_serving", [False, True])
def test_a_cpp_wrapper_that_fails_to_build_launches_from_python_with_one_warning_per_form(
        beside_serving, tiny_checkpoint, monkeypatch, caplog):
    """Without CUDA graphs the decode step launches from inductor's C++ wrapper: built first when nothing is
    served meanwhile, after the Python form when the compile runs beside serving. Where that build fails (no host
    compiler, a construct it lacks) the Python form launches the step: one warning per form, still compiled, the
    eager tokens."""
    from torch._inductor.codegen import cpp_wrapper_cpu

    path, _ = tiny_checkpoint("qwen3_moe")
    expected = _tokens(path, compile="off")
    monkeypatch.setattr(cpp_wrapper_cpu.CppWrapperCpu, "write_header", broken)
    engine = make_engine(path, compile="on")
    graphs = engine.runner.decode_graphs
    assert graphs.kernel_launch == "c++ wrapper"
    # Caches off: a build cached by an earlier test would skip the C++ wrapper's code generation. In every thread
    # that compiles: torch's compile settings are per thread (2.13+).
    run_stage = background_compile.run_stage
    monkeypatch.setattr(background_compile, "run_stage", lambda *args: _run_uncached(run_stage, *args))
    with caplog.at_level(logging.WARNING), _uncached():
        if beside_serving:
            assert engine.compile_in_background().join(300)
        got = [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]
        assert [out.token_ids for out in engine.generate(PROMPTS, PARAMS)] == got
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one per form: beside serving the sampler's C++ form is built too (here greedy requests never reach it)
    forms = ["decode step", "sampler"] if beside_serving else ["decode step"]
    assert len(warnings) == len(forms), warnings
    for form, warning in zip(forms, warnings, strict=True):
        assert f"building the {form} with inductor's C++ wrapper failed" in warning
        assert "no kernel for this shape on this device" in warning
    assert got == expected and engine.runner.decode_graphs is graphs and engine.compile_state != "failed"
    assert graphs.kernel_launch == "python wrapper" and graphs.shapes_run


@contextlib.contextmanager
def _uncached():
    """No compile cache for what compiles in this thread."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _run_uncached(run, *args):
    with _uncached():
        return run(*args)


@pytest.mark.compile
def test_a_recompile_failing_after_the_background_compile_stays_eager(tiny_checkpoint, monkeypatch, caplog):
    """The compiled steps were ready, then a shape they had not seen fails to compile: eager for good, one
    warning, and the engine never moves back to the compiled runner."""
    from server.compile.runner import CompiledRunner
    from server.compile.steps import CompiledSteps

    path, _ = tiny_checkpoint("qwen3")
    expected = _tokens(path, compile="off")
    engine = make_engine(path, compile="on", max_num_seqs=2)
    with monkeypatch.context() as patch:
        patch.setattr(CompiledSteps, "warm_up_stages", lambda self, beside_serving=False: [])  # "ready" at once: nothing compiled
        assert engine.compile_in_background().join(60) and engine.compile_state == "ready"
    monkeypatch.setattr(CompiledRunner, "forward", broken_launch := _raising_forward(CompiledRunner.forward))
    with caplog.at_level(logging.WARNING):
        got = [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]
        assert [out.token_ids for out in engine.generate(PROMPTS, PARAMS)] == got
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compiling the decode step failed" in warnings[0], warnings
    assert got == expected and engine.compile_state == "failed" and engine.runner.decode_graphs is None
    assert broken_launch.calls == 1


def _raising_forward(forward):
    """CompiledRunner.forward that raises a compile failure."""

    def patched(runner, out, prev=None):
        patched.calls += 1
        raise torch._dynamo.exc.TorchDynamoException("no kernel for this shape")

    patched.calls = 0
    return patched


def _raising(exc: Exception):
    def launch(*args):
        raise exc

    return launch


@pytest.mark.compile
def test_a_cpp_wrapper_step_failing_at_run_time_falls_back_only_in_warm_up(caplog):
    """A failure while the C++ form runs reaches the caller (a step that ran part way may not run again); in a
    warm-up call (padding rows, scratch outputs: safe to run twice) it falls back like a failed build."""
    from server.compile.launch_wrapper import LaunchCompiled

    def step_fn(x):
        return x * 2 + 1

    step = LaunchCompiled(step_fn, "the test step", step_fn, fullgraph=True)
    step.compiled = step._cpp_form = _raising(RuntimeError("no such Metal function"))  # built, fails as it runs
    x = torch.randn(5)
    with pytest.raises(RuntimeError, match="no such Metal function"):
        step(x)
    assert step.cpp_wrapper
    with caplog.at_level(logging.WARNING):
        assert torch.equal(step(x, warm_up=True), x * 2 + 1)
        torch.testing.assert_close(step(x + 1), step_fn(x + 1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "building the test step with inductor's C++ wrapper failed" in warnings[0]
    assert "no such Metal function" in warnings[0] and not step.cpp_wrapper


@pytest.mark.compile
def test_a_cpp_form_built_beside_serving_launches_only_once_its_warm_up_ran(caplog):
    """Beside serving the Python form launches the step until the C++ form's warm-up calls have all run; one that
    fails leaves the Python form, with one warning, and the C++ form is never tried again."""
    from server.compile.launch_wrapper import LaunchCompiled

    def step_fn(x):
        return x - 3

    step = LaunchCompiled(step_fn, "the test step", step_fn, fullgraph=True)
    step.python_first()
    x = torch.randn(4)
    assert not step.cpp_wrapper and torch.equal(step(x), x - 3)
    step.build_cpp_form(lambda form: form(x, warm_up=True))
    assert step.cpp_wrapper and torch.equal(step(x), x - 3)

    failing = LaunchCompiled(step_fn, "the failing step", step_fn, fullgraph=True)
    failing.python_first()
    warmed = []
    with caplog.at_level(logging.WARNING):
        failing.build_cpp_form(lambda form: warmed.append(form(x)) or _raising(RuntimeError("no cc1plus"))())
        failing.build_cpp_form(lambda form: warmed.append(form(x)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "building the failing step with inductor's C++ wrapper failed" in warnings[0]
    assert "no cc1plus" in warnings[0] and len(warmed) == 1 and not failing.cpp_wrapper
    assert torch.equal(failing(x), x - 3)
