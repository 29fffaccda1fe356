"""An exception inside one engine step ends only that step's requests (each client is told, under its request id);
the engine frees their blocks and serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams, StepFailedError
from tests.api.harness import RunningServer, run_app, sse_events

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def fail_forward(monkeypatch, runner, at_call: int) -> None:
    """The runner's `at_call`-th forward from now raises; the others run."""
    real_forward, calls = runner.forward, {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise RuntimeError("injected device fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", forward)


def test_a_failing_step_ends_only_its_requests(monkeypatch) -> None:
    engine = Engine.from_pretrained("demo", device="cpu", max_num_seqs=1)
    solo = engine.generate("the small model wakes up", GREEDY)
    first, second = (engine.inputs.make_request(p, GREEDY) for p in ("one two three", "the small model wakes up"))
    engine.add_request(first)
    engine.add_request(second)  # waits: one sequence at a time
    fail_forward(monkeypatch, engine.runner, at_call=2)  # the first request's first decode step
    engine.step()
    with pytest.raises(StepFailedError, match="injected device fault") as info:
        engine.step()
    assert info.value.request_ids == [first.request_id]
    texts = []
    while engine.has_unfinished:
        texts += [d.text for d in engine.step() if d.request_id == second.request_id]
    assert "".join(texts) == solo.text
    assert engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0


@pytest.fixture(scope="module")
def real() -> Iterator[RunningServer]:
    from server.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig.from_flat(model="demo", device="cpu"))
    with run_app(create_app(engine, ServerConfig()), engine) as running:
        yield running


def test_the_server_serves_on_after_a_failed_step(real: RunningServer, monkeypatch) -> None:
    body = {"messages": [{"role": "user", "content": "the small model"}], "max_tokens": 8, "temperature": 0}
    expected = real.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    runner = real.engine.engine.runner

    fail_forward(monkeypatch, runner, at_call=2)
    r = real.post("/v1/chat/completions", {**body, "stream": True})
    data, _ = sse_events(r)
    first_id = json.loads(data[0])["id"]
    error = json.loads(data[-1])["error"]  # the last event: no [DONE] after an error
    assert r.status_code == 200 and first_id in error["message"] and "injected device fault" in error["message"]

    fail_forward(monkeypatch, runner, at_call=1)
    r = real.post("/v1/chat/completions", body)
    assert r.status_code == 500 and "request chatcmpl-" in r.json()["error"]["message"]

    monkeypatch.undo()
    again = real.post("/v1/chat/completions", body)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected
    assert httpx.get(f"{real.url}/health").status_code == 200
    assert real.engine.stats().num_running == 0
