"""benchmarks/fake_compile_cache.py: a compile on fake tensors (no weights) fills the cache a real compile hits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fake_compile_cache.py"


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="inductor needs a C compiler on the CPU")
def test_a_compile_on_fake_weights_fills_the_cache_the_real_compile_hits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    records = {}
    for role, cache in (("fill", "filled"), ("filled", "filled"), ("cold", "cold")):
        out = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny-moe", "--role", role, "--cache-dir",
                              str(tmp_path / cache)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        records[role] = json.loads(out.stdout.strip().splitlines()[-1])
    assert (records["fill"]["fxgraph_cache_miss"], records["fill"]["fxgraph_cache_hit"]) == (1, 0)
    assert (records["filled"]["fxgraph_cache_miss"], records["filled"]["fxgraph_cache_hit"]) == (0, 1)
    assert (records["cold"]["fxgraph_cache_miss"], records["cold"]["fxgraph_cache_hit"]) == (1, 0)
    assert all(r["stage_s"] > 0 for r in records.values())
