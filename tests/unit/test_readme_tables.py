"""The README's models-and-memory table is the one benchmarks/model_memory.py computes from the presets, and each of
its cells follows the fit rule the README states."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT, run_benchmark

MEMORY_GB = (16, 24, 36, 48, 64, 96, 128)


@pytest.fixture(scope="module")
def computed_table() -> str:
    return run_benchmark("model_memory.py", timeout=300).stdout.strip()


def test_readme_memory_table_is_the_computed_one(computed_table):
    assert computed_table in (ROOT / "README.md").read_text(), \
        "regenerate it: PYTHONPATH=. python3 benchmarks/model_memory.py"


def test_each_cell_fits_weights_kv_and_overhead_in_the_usable_share(computed_table):
    """The README: a form fits when its weights, a bf16 KV cache of 32k tokens and 2 GB fit in about 2/3 of unified
    memory up to 36 GB and 3/4 above; bf16 where it fits, else FP8, else none."""
    rows = [line.split(" | ") for line in computed_table.splitlines()[2:]]
    assert len(rows) >= 5
    for cells in rows:
        bf16_gb, fp8_gb = (float(re.match(r"([\d.]+) GB", cells[i]).group(1)) for i in (3, 4))
        kv_gb = float(cells[5].removesuffix(" MiB")) * 2**20 * 32 / 1e9
        for memory_gb, cell in zip(MEMORY_GB, cells[6:13], strict=True):
            usable = memory_gb * (2 / 3 if memory_gb <= 36 else 3 / 4)
            expected = next((form for form, gb in (("bf16", bf16_gb), ("fp8", fp8_gb)) if gb + kv_gb + 2 <= usable), "-")
            assert cell == expected, (cells[0], memory_gb)
