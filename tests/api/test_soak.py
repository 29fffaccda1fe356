"""The soak (benchmarks/soak.py) in short: 150 requests from 32 concurrent clients, a fifth of them hanging up
before, during or after their upload, some over-long and some invalid, against `mps-serve serve` on the demo model."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark

pytestmark = pytest.mark.slow


def test_short_soak_leaves_the_server_clean_and_answers_right(tmp_path) -> None:
    out = tmp_path / "soak.json"
    run_benchmark("soak.py", "--requests", "150", "--concurrency", "32", "--prompts", "6", "--rss-every", "50",
                  "--seed", "1", "--json", str(out), timeout=540)  # exits 1 when a check fails
    summary = json.loads(out.read_text())
    assert summary["ok"], summary
    assert summary["outcomes"]["completed"] >= 75 and summary["greedy_texts_checked"] >= 75
    assert sum(n for where, n in summary["outcomes"].items() if where.startswith("hung up")) >= 15
