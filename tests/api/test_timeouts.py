"""Idle and stalled clients are cut off: no request head in time -> closed; a body that stalls -> 408, closed.
Raw sockets against a real uvicorn with the server's own settings."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from server.api.app import create_app
from server.api.server import uvicorn_config
from server.config import ServerConfig
from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, run_app, sse_events

TIMEOUT_S = 0.5
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    config = ServerConfig(host="127.0.0.1", port=0, log_level="warning", header_timeout_s=TIMEOUT_S,
                          body_timeout_s=TIMEOUT_S)
    engine = FakeEngine()
    app = create_app(engine, config)
    with run_app(app, engine, uvicorn_config(app, config)) as running:
        yield running


def _connect(srv: RunningServer) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (the connection stays open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _head(path: str = "/v1/chat/completions", length: int = len(BODY)) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_connection_that_sends_nothing_is_closed(srv: RunningServer) -> None:
    with _connect(srv) as sock:
        data, waited = _read_until_closed(sock)
    assert data == b"" and TIMEOUT_S * 0.8 < waited < TIMEOUT_S + 5


def test_a_request_head_that_stops_halfway_is_closed(srv: RunningServer) -> None:
    with _connect(srv) as sock:
        sock.sendall(_head()[:30])
        data, waited = _read_until_closed(sock)
    assert data == b"" and waited < TIMEOUT_S + 5


def test_the_deadline_restarts_after_each_response_on_a_kept_alive_connection(srv: RunningServer) -> None:
    with _connect(srv) as sock:
        for _ in range(2):  # each request well inside the deadline, the pair past it
            time.sleep(TIMEOUT_S * 0.6)
            sock.sendall(_head() + BODY)
            assert _read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(_head()[:30])
        data, _ = _read_until_closed(sock)
    assert b"HTTP/1.1" not in data


def test_a_stalled_body_is_a_408_and_the_connection_closes(srv: RunningServer) -> None:
    with _connect(srv) as sock:
        sock.sendall(_head() + BODY[:10])
        data, waited = _read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and waited < TIMEOUT_S + 5
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}
    assert 'status="408"' in srv.metrics() and 'status="500"' not in srv.metrics()


def test_a_stream_longer_than_the_timeouts_is_not_cut(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["a", "b", "c", "d"], delay_s=TIMEOUT_S / 2)
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    data, _ = sse_events(r)
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1]) == "abcd"
