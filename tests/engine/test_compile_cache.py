"""The compile cache: a restart reads it, and entries that are corrupt are ignored (torch warns and compiles
again), never a crash or a different answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.compile, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
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


WARM_UP_SCRIPT = """
import json, time
from torch._dynamo.utils import counters
from server.engine.engine import Engine
engine = Engine.from_pretrained("demo", device="cpu", compile="on", max_num_seqs=2, max_model_len=128)
start = time.perf_counter()
engine.warm_up()
print(json.dumps({"seconds": time.perf_counter() - start, **dict(counters["inductor"])}))
"""


def test_a_warm_restart_compiles_nothing(tmp_path):
    """The second start with the same cache finds every graph of its warm-up in inductor's FX graph cache, or
    (the decode step, torch >= 2.13) saved whole: no graph is compiled again (torch keys each entry on its
    version, device, dtypes, shapes and graph, so a different one misses instead of reusing a stale entry)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", WARM_UP_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("fxgraph_cache_miss", 0) > 0
    assert warm.get("fxgraph_cache_miss", 0) == 0 and warm.get("fxgraph_cache_hit", 0) >= cold["fxgraph_cache_miss"]
