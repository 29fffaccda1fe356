"""The `mps-serve` command: generate on the demo model and info, as a user runs them (subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys


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
