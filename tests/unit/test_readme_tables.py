"""The README's models-and-memory table is the one benchmarks/model_memory.py computes from the presets."""

from __future__ import annotations

from pathlib import Path

from benchmarks.model_memory import fitting, table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_memory_table_is_the_computed_one():
    assert table() in (ROOT / "README.md").read_text(), "regenerate it: PYTHONPATH=. python3 benchmarks/model_memory.py"


def test_fit_counts_weights_kv_and_overhead_against_the_usable_share():
    row = {"bf16": 20e9, "fp8": 10e9, "kv_per_token": 131072}  # 32k tokens of KV: 4.3 GB
    # usable 10.7, 16, 24, 36 GB; needed 16.3 GB in FP8, 26.3 GB in bf16
    assert [fitting(row, gb) for gb in (16, 24, 36, 48)] == ["-", "-", "fp8", "bf16"]
