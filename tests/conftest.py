"""Shared fixtures: tiny random-weight checkpoints (built by tests/helpers.py), a fresh dynamo per test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import build_tiny, build_tiny_fim, build_tiny_hybrid


def _built_once(tmp_path_factory, build: Callable[[str, Path], object]) -> Callable[[str], tuple[Path, object]]:
    """Factory: name -> (checkpoint dir, HF model), each name built on first use only."""
    cache: dict = {}

    def make(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, build(name, path))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: model_type (llama, qwen3, qwen3_moe) -> (path, hf_model), cached per session."""
    return _built_once(tmp_path_factory, build_tiny)


@pytest.fixture(scope="session")
def tiny_fim_checkpoint(tmp_path_factory):
    """(path, hf_model): a tiny qwen3 whose tokenizer carries Qwen2.5-Coder's FIM tokens (helpers.build_tiny_fim)."""
    path = tmp_path_factory.mktemp("fim")
    return path, build_tiny_fim(path)


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    """Factory: hybrid arch (tests/helpers.tiny_hybrid_configs) -> (path, hf_model), per-expert and sharded."""
    return _built_once(tmp_path_factory, build_tiny_hybrid)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled code: dynamo keeps its graphs per code object, so engines built by
    earlier tests (same forward functions, other instances) would count against its recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def no_saved_compiles(monkeypatch):
    """Compiled steps are not saved whole (saved_compile) unless a test asks for it (tests/engine/
    test_saved_compile.py): a step saved by an earlier test would spare a later one the trace it checks, and
    tracing to save skips inductor's FX graph cache, which keeps the suite's compiles short."""
    import server.compile.steps
    import server.compile.twin
    import server.compile.worker

    for module in (server.compile.steps, server.compile.worker, server.compile.twin):
        monkeypatch.setattr(module, "saved_steps_dir", lambda spec: None)


@pytest.fixture(autouse=True)
def compile_in_process(monkeypatch):
    """Background compiles run in the serving process unless a test asks for the compile child
    (tests/engine/test_compile_child.py): a child per test would double the suite's compile work, and tests that
    patch a stage in this process would wait for a child that knows nothing of the patch."""
    import server.compile.steps

    monkeypatch.setattr(server.compile.steps, "start_compile_child", lambda engine, stages: None)
