"""Large inputs are rendered and tokenized off the event loop: other clients, /health included, are served meanwhile."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.api.harness import RunningServer, wait_until

BIG = "abcdefghijklmno " * 3000  # past the off-loop size, under the fake context of 4096 words


def _health_while_gated(srv: RunningServer, path: str, body: dict) -> httpx.Response:
    srv.engine.input_gate = gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(srv.post, path, body)
        wait_until(lambda: srv.engine.num_gated > 0)
        health = httpx.get(f"{srv.url}/health", timeout=5)  # inline work would hold it until the gate opens
        assert health.status_code == 200 and not pending.done()
        gate.set()
        return pending.result()


def test_large_chat_is_rendered_off_the_event_loop(srv: RunningServer) -> None:
    r = _health_while_gated(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello, world!"


def test_large_completion_prompt_is_tokenized_off_the_event_loop(srv: RunningServer) -> None:
    r = _health_while_gated(srv, "/v1/completions", {"prompt": BIG, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello, world"
