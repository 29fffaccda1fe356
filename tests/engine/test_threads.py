"""The CPU thread policy: half the cores (1 to 8) by default, --cpu-threads to choose, applied when the engine is built."""

from __future__ import annotations

import asyncio

import pytest
import torch

from server import cli
from server.config import EngineConfig
from server.engine import threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_cores, expected", [(1, 1), (2, 1), (6, 3), (16, 8), (128, 8)])
def test_default_is_half_the_cores_between_1_and_8(monkeypatch, num_cores, expected) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(num_cores)), raising=False)
    assert threads.default_cpu_threads() == expected


def test_serve_applies_cpu_threads_at_engine_start(tmp_path, monkeypatch, restore_threads) -> None:
    monkeypatch.setenv("MPS_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = {}

    def run_server(config, engine_factory):
        torch.set_num_threads(2)
        engine = engine_factory()
        seen["threads"] = torch.get_num_threads()
        asyncio.run(engine.shutdown())
        return 0

    monkeypatch.setattr("server.api.server.run_server", run_server)
    assert cli.main(["--log-level", "warning", "serve", "demo", "--device", "cpu", "--cpu-threads", "3"]) == 0
    assert seen["threads"] == 3


def test_the_default_is_applied_and_nonsense_refused(restore_threads) -> None:
    torch.set_num_threads(threads.default_cpu_threads() + 1)
    assert threads.apply_cpu_threads(None) == threads.default_cpu_threads() == torch.get_num_threads()
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig.from_flat(cpu_threads=0)
