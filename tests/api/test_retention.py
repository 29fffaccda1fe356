"""A refused request leaves nothing behind: its text and token list are freed by reference counting alone, with no
full garbage collection (one can be minutes away, and a prompt's tokens are hundreds of megabytes at scale)."""

from __future__ import annotations

import gc
import http.client
import json
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from tests.api.harness import RunningServer, run_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real() -> Iterator[RunningServer]:
    from server.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig.from_flat(model="demo", device="cpu"))
    with run_app(create_app(engine, ServerConfig()), engine) as running:
        yield running


@pytest.mark.parametrize("path, words", [
    ("/v1/chat/completions", 24_000),  # rendered and tokenized on a worker thread
    ("/v1/completions", 6_000),  # small enough to be tokenized on the event loop
])
def test_a_refused_overlong_prompt_retains_no_memory(real: RunningServer, path: str, words: int) -> None:
    text = "tok " * words  # one token per word: more than the context holds, under the cheap refusal's bound
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    raw = json.dumps(body).encode()  # encoded once, sent on one connection: the client keeps nothing per request
    client = http.client.HTTPConnection(*real.url.removeprefix("http://").split(":"), timeout=30)

    def refuse() -> None:
        client.request("POST", path, raw, {"content-type": "application/json"})
        r = client.getresponse()
        answer = json.loads(r.read())
        assert r.status == 400 and answer["error"]["code"] == "context_length_exceeded", answer

    refuse()  # first-use allocations (connections, caches) out of the way
    gc.collect()
    gc.disable()
    tracemalloc.start()
    token_list_bytes = words * 8  # the list's pointers alone; its int objects add about four times that
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            refuse()
        # the server unwinds the request after the response is out: give it a moment, never a collection
        deadline = time.monotonic() + 3
        while (growth := tracemalloc.get_traced_memory()[0] - before) >= token_list_bytes / 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        tracemalloc.stop()
        gc.enable()
        client.close()
    assert growth < token_list_bytes / 2, f"{growth} bytes retained by 3 refused requests"
