"""One server per test module serving create_app(FakeEngine) (tests/api/harness.py), reset before each test;
or, for the modules that need real generation, one serving the demo model on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, serve


@pytest.fixture(scope="module")
def shared() -> Iterator[RunningServer]:
    """One server per test module; tests set `shared.engine.script` (reset before each test)."""
    with serve(FakeEngine(), served_model_name="fake-served", model_aliases=("alias-a",)) as running:
        yield running


@pytest.fixture(scope="module")
def demo_server() -> Iterator[RunningServer]:
    """The demo model (random weights) behind a real uvicorn, one per test module."""
    from server.api.app import create_app
    from server.config import EngineConfig, ServerConfig
    from server.engine.async_engine import AsyncEngine
    from tests.api.harness import run_app

    engine = AsyncEngine.from_config(EngineConfig.from_flat(model="demo", device="cpu"))
    with run_app(create_app(engine, ServerConfig(served_model_name="demo")), engine) as running:
        yield running


@pytest.fixture
def srv(shared: RunningServer) -> RunningServer:
    shared.engine.script = Script()
    shared.engine.submit_error = None
    shared.engine.input_gate = None
    shared.engine.num_waiting = 0
    return shared
