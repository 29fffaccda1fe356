"""The compile cache: a restart reads it, and entries that are corrupt are ignored (torch warns and compiles
again), never a crash or a different answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                   reason="inductor needs a C compiler on the CPU")]


def generate(cache_dir: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "server", "generate", "demo", "--prompt", "the cache", "--max-tokens", "6",
               "--device", "cpu", "--config", str(config)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_a_corrupt_compile_cache_is_ignored_with_a_warning(tmp_path):
    config = tmp_path / "compile.toml"
    config.write_text('[engine]\ncompile = "on"\n')
    cache = tmp_path / "inductor"
    cold = generate(cache, config)
    assert cold.returncode == 0, cold.stderr[-2000:]
    entries = [f for f in cache.rglob("*") if f.is_file() and "locks" not in f.parts]
    assert entries  # the compiled step was cached where asked
    for entry in entries:
        entry.write_bytes(b"not what torch wrote")
    warm = generate(cache, config)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout == cold.stdout  # greedy: the same text, compiled again
