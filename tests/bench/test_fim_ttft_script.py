"""benchmarks/fim_ttft.py end to end on the CPU, run as a script: the FIM, plain and /infill requests it times carry
prompts of the same length (the FIM layout adds its three tokens) and each gets a first token."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark


def test_fim_ttft_script_times_prompts_of_the_same_length(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    out = tmp_path / "fim.jsonl"
    run_benchmark("fim_ttft.py", "--prompt-tokens", "96", "--reps", "1", "--json", str(out), timeout=300)
    record = json.loads(out.read_text())
    tokens = record["prompt_tokens"]
    assert tokens["fim"] == tokens["infill"] == tokens["plain"] + 3 and 80 <= tokens["plain"] <= 112
    assert all(ms > 0 for ms in record["ttft_ms_median"].values())
