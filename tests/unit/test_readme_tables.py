"""The README's models-and-memory tables are the ones benchmarks/model_memory.py computes from the presets (with
server/engine/model_size.py, as `mps-serve info MODEL` does), and each fit cell follows the rule the README states."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT, run_benchmark

MEMORY_GB = (16, 24, 32, 36, 48, 64, 96, 128)
FORMS = ("bf16", "fp8", "int8", "int4")


@pytest.fixture(scope="module")
def computed_tables() -> tuple[str, str]:
    sizes, fits = run_benchmark("model_memory.py", timeout=300).stdout.strip().split("\n\n")
    return sizes, fits


def test_readme_memory_tables_are_the_computed_ones(computed_tables):
    readme = (ROOT / "README.md").read_text()
    for table in computed_tables:
        assert table in readme, "regenerate them: PYTHONPATH=. python3 benchmarks/model_memory.py"


def test_each_fit_cell_fits_weights_kv_and_overhead_in_the_usable_share(computed_tables):
    """The README: a form fits when its weights, a bf16 KV cache of 32k tokens and 2 GB fit in about 2/3 of unified
    memory up to 36 GB and 3/4 above; a cell names the first of bf16, FP8, int8, int4 that fits, else -."""
    size_rows = [line.strip("| ").split(" | ") for line in computed_tables[0].splitlines()[2:]]
    fit_lines = computed_tables[1].splitlines()
    models = fit_lines[0].strip("| ").split(" | ")[1:]
    fit_rows = [line.strip("| ").split(" | ") for line in fit_lines[2:]]
    assert [row[0] for row in size_rows] == models and len(models) >= 5
    assert [row[0] for row in fit_rows] == [f"{gb} GB" for gb in MEMORY_GB]
    for column, cells in enumerate(size_rows, start=1):
        weights_gb = [float(re.match(r"([\d.]+) GB", cells[i]).group(1)) for i in (3, 4, 5, 6)]
        kv_gb = float(cells[7].removesuffix(" MiB")) * 2**20 * 32 / 1e9
        for memory_gb, row in zip(MEMORY_GB, fit_rows, strict=True):
            usable = memory_gb * (2 / 3 if memory_gb <= 36 else 3 / 4)
            expected = next((form for form, gb in zip(FORMS, weights_gb, strict=True) if gb + kv_gb + 2 <= usable), "-")
            assert row[column] == expected, (cells[0], memory_gb)


def test_affine_columns_state_mlx_bits_per_weight(computed_tables):
    """int8 / int4 in groups of 64 with a scale and a bias per group: 8.5 and 4.5 bits per weight, a little
    more where routers stay at 8 bits."""
    for line in computed_tables[0].splitlines()[2:]:
        cells = line.strip("| ").split(" | ")
        int8, int4 = (float(re.search(r"\(([\d.]+)\)", cells[i]).group(1)) for i in (5, 6))
        assert 8.5 <= int8 < 8.6 and 4.5 <= int4 < 4.6, cells[0]
