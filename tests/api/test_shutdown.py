"""run_server in a subprocess: /health 503 while the model loads, SIGINT/SIGTERM let a stream finish (or ends it
cleanly after the grace period), the engine is shut down, and the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.api.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import sys, time
from pathlib import Path
from server.api.server import run_server
from server.config import Config, EngineConfig, ServerConfig
from server.engine.types import ModelLoadError
from tests.api.fake_engine import FakeEngine, Script

port, mode, flag, grace = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])

def factory():
    if mode == "fail":
        raise ModelLoadError("no checkpoint at /nope")
    while not flag.exists():  # "loading" lasts until the test says so
        time.sleep(0.01)
    num_pieces = 50 if mode == "short" else 100_000
    engine = FakeEngine(Script(pieces=[f"p{i} " for i in range(num_pieces)], delay_s=0.02))
    shutdown = engine.shutdown
    async def reporting_shutdown():
        await shutdown()
        print("ENGINE_SHUTDOWN", flush=True)
    engine.shutdown = reporting_shutdown
    return engine

config = Config(engine=EngineConfig.from_flat(model="fake/model"), server=ServerConfig(port=port, log_level="info"))
sys.exit(run_server(config, factory, shutdown_grace_s=grace))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tmp_path: Path, mode: str, grace_s: float) -> tuple[subprocess.Popen, str, Path]:
    port, flag = _free_port(), tmp_path / "loaded"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(port), mode, str(flag), str(grace_s)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, f"http://127.0.0.1:{port}", flag


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def _stream_in_thread(url: str) -> tuple[threading.Thread, list[str]]:
    lines: list[str] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines


@pytest.mark.parametrize("mode, grace_s, sig", [("short", 30.0, signal.SIGINT), ("long", 0.2, signal.SIGTERM)])
def test_signal_drains_streams_and_exits_0(tmp_path: Path, mode: str, grace_s: float, sig: int) -> None:
    proc, url, flag = _start(tmp_path, mode, grace_s)
    try:
        wait_until(lambda: _health(url) is not None, timeout_s=60)
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        flag.touch()
        wait_until(lambda: _health(url) == 200, timeout_s=30)
        thread, lines = _stream_in_thread(url)
        wait_until(lambda: len(lines) >= 3)  # role chunk and some content are out
        num_lines_at_signal = len(lines)
        proc.send_signal(sig)
        thread.join(timeout=60)
        assert not thread.is_alive()
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "ENGINE_SHUTDOWN" in output
    assert output.count("Application startup complete") == 1  # said once, when the model serves
    payloads = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert len(lines) > num_lines_at_signal  # the stream went on after the signal
    if mode == "short":  # finished within the grace period: the whole answer, then [DONE]
        assert lines[-1] == "data: [DONE]"
        text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p.get("choices"))
        assert text == "".join(f"p{i} " for i in range(50))
    else:  # aborted after the grace period: one error event, the stream closes
        assert payloads[-1]["error"]["code"] == "server_shutdown" and "[DONE]" not in lines[-1]


def test_model_load_failure_exits_1_with_one_error_line(tmp_path: Path) -> None:
    proc, _, _ = _start(tmp_path, "fail", 1.0)
    output, _ = proc.communicate(timeout=60)
    lines = output.strip().splitlines()
    assert proc.returncode == 1, output
    assert "Application startup complete" not in output  # the model never served
    assert "could not load the model: ModelLoadError: no checkpoint at /nope" in lines[-1]  # the last word
    assert sum("/nope" in line for line in lines) == 1 and "Traceback" not in output
