"""The `mps-serve` command: generate on the demo model and info, as a user runs them (subprocess); serve's engine
factory in process."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys

from server import cli


def run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPS_SERVE_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "server", *args], env=env, capture_output=True, text=True, timeout=180)


def test_generate_demo_with_no_network(tmp_path):
    done = run_cli("generate", "demo", "--prompt", "hi", "--max-tokens", "5", "--chat", "--device", "cpu", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "generated" in done.stderr and "finish_reason=" in done.stderr
    assert (tmp_path / "demo-v1" / "model.safetensors").is_file()


def test_generate_errors_say_what_to_fix(tmp_path):
    done = run_cli("generate", str(tmp_path / "nope"), "--prompt", "hi", tmp_path=tmp_path)
    assert done.returncode == 2 and "mps-serve: error:" in done.stderr and "nope" in done.stderr
    done = run_cli("generate", "demo", "--prompt", "hi", "--max-tokens", "0", "--device", "cpu", tmp_path=tmp_path)
    assert done.returncode == 2 and "max_tokens must be at least 1" in done.stderr


def test_info_explains_the_device_choice(tmp_path):
    done = run_cli("info", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "MPS:" in done.stdout and "device:" in done.stdout and "fast paths:" in done.stdout
    assert "flex_decode" not in done.stdout  # compiling probes only on request


def test_info_compile_probes_say_whether_flex_decode_runs(tmp_path):
    done = run_cli("info", "--device", "cpu", "--compile-probes", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "flex_decode" in line)
    assert line.split()[1] in ("yes", "no") and len(line.split()) > 3  # a verdict and its reason


def test_serve_freezes_what_start_up_left_for_the_gc(tmp_path, monkeypatch):
    """serve's engine factory warms up and then moves the start-up objects out of the cyclic GC's reach (a full
    collection walking the compiled graphs stalled every stream for 1.4-2.4 s on the H200). In process: the
    server itself is replaced by a call of the factory."""
    monkeypatch.setenv("MPS_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    frozen = {}

    def run_server(config, engine_factory):
        gc.unfreeze()
        engine = engine_factory()
        frozen["engine"] = gc.get_freeze_count()
        gc.unfreeze()
        asyncio.run(engine.shutdown())
        return 0

    monkeypatch.setattr("server.api.server.run_server", run_server)
    assert cli.main(["--log-level", "warning", "serve", "demo", "--device", "cpu"]) == 0
    assert frozen["engine"] > 10_000  # the model, tokenizer and engine objects, at least
