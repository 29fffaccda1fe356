"""The soak (benchmarks/soak.py) in short: 150 requests from 32 concurrent clients, a fifth of them hanging up
before, during or after their upload, some over-long and some invalid, against `mps-serve serve` on the demo model."""

from __future__ import annotations

import pytest

from benchmarks.soak import run

pytestmark = pytest.mark.slow


def test_short_soak_leaves_the_server_clean_and_answers_right() -> None:
    summary = run(num_requests=150, concurrency=32, num_prompts=6, rss_every=50, seed=1)
    assert summary["ok"], summary
    assert summary["outcomes"]["completed"] >= 75 and summary["greedy_texts_checked"] >= 75
    assert sum(n for where, n in summary["outcomes"].items() if where.startswith("hung up")) >= 15
