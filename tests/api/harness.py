"""A real uvicorn on 127.0.0.1 (ephemeral port, background thread) serving an app, and readers of its SSE bodies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from server.api.app import create_app
from server.config import ServerConfig
from tests.api.fake_engine import FakeEngine


@dataclass
class RunningServer:
    url: str
    engine: Any
    server: uvicorn.Server

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=30, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30, **kwargs)

    def metrics(self) -> str:
        return self.get("/metrics").text


@contextmanager
def run_app(app: Any, engine: Any = None, config: uvicorn.Config | None = None) -> Iterator[RunningServer]:
    """`config`: uvicorn's, for its port 0 (any free one); by default a plain uvicorn on 127.0.0.1."""
    config = config or uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@contextmanager
def serve(engine: Any = None, **server_config: Any) -> Iterator[RunningServer]:
    engine = engine if engine is not None else FakeEngine()
    app = create_app(engine, ServerConfig(**server_config))
    with run_app(app, engine) as running:
        yield running


def sse_events(response: httpx.Response) -> tuple[list[str], list[str]]:
    """Parse a raw SSE body line by line, as Zed and Continue do: (data payloads, comment lines).
    Asserts the framing: every event is one `data:` line or one comment followed by a blank line."""
    data, comments = [], []
    lines = response.text.split("\n")
    assert lines[-2:] == ["", ""], "the stream must end with a blank line"
    i = 0
    while i < len(lines) - 1:
        line = lines[i]
        if line.startswith(":"):
            comments.append(line)
        else:
            assert line.startswith("data: "), f"unexpected SSE line {line!r}"
            data.append(line[len("data: "):])
        assert lines[i + 1] == "", f"event not terminated by a blank line after {line!r}"
        i += 2
    return data, comments


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def chunks_of(data: list[str]) -> list[dict[str, Any]]:
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse an SSE body of named events (Anthropic, Responses): (event name, data object) per event. Asserts the
    framing: one `event:` line, one single-line `data:` whose `type` is the event name, a blank line."""
    assert text.endswith("\n\n"), "the stream must end with a blank line"
    events = []
    for raw in text[:-2].split("\n\n"):
        lines = raw.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), raw
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    return events
