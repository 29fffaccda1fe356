"""The serving thread runs the model eagerly while the background compile traces it: torch.fx's tracer replaces
nn.Module.__call__ and __getattr__ process-wide while it traces, which a shielded model does not notice."""

from __future__ import annotations

import threading

import torch
from torch import nn

from server.engine.types import SamplingParams
from server.models.tracing_shield import shield_from_tracing
from tests.helpers import make_engine, random_ids

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _fx_patches(monkeypatch) -> None:
    """What FX's tracer does to nn.Module while it traces on another thread, made to fail loudly here."""
    def traced(*args, **kwargs):
        raise NameError("module is not installed as a submodule")

    monkeypatch.setattr(nn.Module, "__call__", traced)
    monkeypatch.setattr(nn.Module, "__getattr__", traced)


def test_a_shielded_model_gives_the_same_tokens_while_nn_module_is_patched(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    engine = make_engine(path, compile="off")
    prompt = random_ids(9, 2)
    expected = engine.generate(prompt, PARAMS).token_ids
    names = [name for name, _ in engine.model.named_parameters()]
    shield_from_tracing(engine.model)
    classes = [type(m) for m in engine.model.modules()]
    shield_from_tracing(engine.model)  # idempotent: no subclass of a subclass
    assert [type(m) for m in engine.model.modules()] == classes
    assert [name for name, _ in engine.model.named_parameters()] == names
    assert any(isinstance(m, nn.Linear) for m in engine.model.modules())
    with monkeypatch.context() as patch:
        _fx_patches(patch)
        assert engine.generate(prompt, PARAMS).token_ids == expected


def test_a_shielded_module_runs_while_fx_traces_on_another_thread():
    layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    shield_from_tracing(layers)
    x = torch.randn(2, 8)
    expected = layers(x)
    stop = threading.Event()

    def trace_repeatedly() -> None:
        while not stop.is_set():
            torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))

    tracer = threading.Thread(target=trace_repeatedly)
    tracer.start()
    try:
        for _ in range(300):
            torch.testing.assert_close(layers(x), expected, rtol=0, atol=0)
    finally:
        stop.set()
        tracer.join()
