"""A client that leaves aborts its engine request (visible in /metrics); API keys; CORS; metrics."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading

import httpx
import openai
import pytest

from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import serve, wait_until


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("before_first_token", [True, False])
def test_disconnect_aborts_the_request(stream: bool, before_first_token: bool) -> None:
    gate = threading.Event()
    script = Script(pieces=["tok"] * 10_000, delay_s=0.01, gate=gate if before_first_token else None)
    engine = FakeEngine(script)
    with serve(engine, keepalive_interval_s=0.05) as running:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
        sock = _raw_post(running.url, "/v1/chat/completions", body)
        wait_until(lambda: len(engine.running) == 1)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
        wait_until(lambda: len(engine.aborted) == 1)
        assert engine.aborted == [engine.submitted[0][0]]
        wait_until(lambda: not engine.running)
        metrics = running.metrics()
        assert _metric(metrics, "mps_serve_requests_finished_total", '{finish_reason="abort"}') == 1
        assert _metric(metrics, "mps_serve_num_requests_running") == 0
        # the server is still healthy for the next client
        engine.script = Script(pieces=["ok"])
        assert running.post("/v1/chat/completions", {"messages": body["messages"], "max_tokens": 2}).status_code == 200


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_during_upload_is_not_a_server_error() -> None:
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("mps_serve.api", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with serve() as running:
            host, port = running.url.removeprefix("http://").split(":")
            for path in ("/v1/chat/completions", "/v1/completions"):
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 'Content-Length: 100000\r\n\r\n{"messages": ['.encode())
                wait_until(lambda path=path: f'endpoint="{path}"' in running.metrics())
            metrics = running.metrics()
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert not re.findall(r'status="5\d\d"', metrics), metrics
    assert _metric(metrics, "mps_serve_http_requests_total", '{endpoint="/v1/completions",status="499"}') == 1
    assert not [r for r in records.records if r.levelno >= logging.WARNING or r.exc_info], records.records
    assert len(records.records) <= 2  # at most one line per aborted upload


def test_metrics_count_requests_tokens_and_engine_gauges() -> None:
    engine = FakeEngine(Script(pieces=["a", "b", "c"], cached_tokens=1))
    with serve(engine) as running:
        client = running.client()
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one two"}])
        list(client.completions.create(model="m", prompt="x y z", stream=True))
        running.post("/v1/chat/completions", {"messages": []})
        running.get("/nope")
        metrics = running.metrics()
        prompt_tokens = sum(len(p.split()) for _, p, _ in engine.submitted)
        assert _metric(metrics, "mps_serve_prompt_tokens_total") == prompt_tokens
        assert _metric(metrics, "mps_serve_cached_prompt_tokens_total") == 2
        assert _metric(metrics, "mps_serve_generation_tokens_total") == 6
        assert _metric(metrics, "mps_serve_requests_finished_total", '{finish_reason="stop"}') == 2
        assert _metric(metrics, "mps_serve_http_requests_total", '{endpoint="/v1/chat/completions",status="200"}') == 1
        assert _metric(metrics, "mps_serve_http_requests_total", '{endpoint="/v1/chat/completions",status="400"}') == 1
        assert _metric(metrics, "mps_serve_http_requests_total", '{endpoint="other",status="404"}') == 1
        assert _metric(metrics, "mps_serve_time_to_first_token_seconds_count") == 2
        assert _metric(metrics, "mps_serve_inter_token_latency_seconds_count") == 4
        stats = engine.stats()
        assert _metric(metrics, "mps_serve_kv_blocks_free") == stats.kv_blocks_free
        assert _metric(metrics, "mps_serve_prefix_cache_hit_tokens_total") == stats.prefix_cache_hit_tokens
        assert _metric(metrics, "mps_serve_num_requests_waiting") == stats.num_waiting
        assert _metric(metrics, "mps_serve_bits_per_weight") == stats.bits_per_weight == 4.5


def test_health_and_metrics_report_the_compile_state() -> None:
    """Requests are served while the compiled decode step is built: /health is 200 and says so, /metrics too."""
    engine = FakeEngine(Script(pieces=["a"]))
    engine.compile_state = "compiling"
    with serve(engine) as running:
        health = running.get("/health")
        assert health.status_code == 200 and health.json()["compile"] == "compiling"
        assert running.client().completions.create(model="m", prompt="x").choices[0].text == "a"
        metrics = running.metrics()
        assert _metric(metrics, "mps_serve_compile_state", '{state="compiling"}') == 1
        assert _metric(metrics, "mps_serve_compile_state", '{state="ready"}') == 0
        engine.compile_state = "failed"
        assert running.get("/health").json()["compile"] == "failed"
        assert _metric(running.metrics(), "mps_serve_compile_state", '{state="failed"}') == 1


def test_api_key() -> None:
    with serve(FakeEngine(), api_key="s3cret") as running:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            r = running.post("/v1/chat/completions", body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert running.get("/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        assert running.client("s3cret").chat.completions.create(model="m", messages=body["messages"]).choices
        assert running.get("/health").status_code == 200 and running.get("/metrics").status_code == 200


def test_cors_off_by_default_and_on_with_allowed_origins() -> None:
    preflight = {"Origin": "http://editor.local", "Access-Control-Request-Method": "POST"}
    with serve(FakeEngine()) as running:
        r = httpx.options(f"{running.url}/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = running.get("/v1/models", headers={"Origin": "http://editor.local"})
        assert "access-control-allow-origin" not in r.headers
    with serve(FakeEngine(), allowed_origins=("http://editor.local",), api_key="k") as running:
        r = httpx.options(f"{running.url}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://editor.local"
        r = running.get("/v1/models", headers={"Origin": "http://editor.local", "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "http://editor.local"
        r = running.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers


def test_prompts_are_not_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    secret = "correct-horse-battery-staple"
    with caplog.at_level("INFO"), serve(FakeEngine()) as running:
        running.client().chat.completions.create(model="m", messages=[{"role": "user", "content": secret}])
        running.client().completions.create(model="m", prompt=secret)
    assert caplog.records and not any(secret in r.getMessage() for r in caplog.records)
