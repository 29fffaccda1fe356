"""benchmarks/sse_delivery.py end to end on the CPU, run as a script: every stream gets all its tokens and the
engine's text (in its own prompt's place), with connections opened inside the timed run or before it, from one
client process or one per stream sending together."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import run_benchmark


@pytest.mark.parametrize("open_connections, client_processes", [(False, 1), (True, 1), (True, 3)])
def test_sse_delivery_script_streams_the_engine_text(tmp_path, open_connections, client_processes):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    out = tmp_path / "sse.jsonl"
    argv = ["--preset", "tiny-moe", "--device", "cpu", "--streams", "1,3", "--max-tokens", "6", "--prompt-len", "8",
            "--reps", "1", "--json", str(out), "--client-processes", str(client_processes)]
    argv += ["--open-connections"] if open_connections else []
    run_benchmark("sse_delivery.py", *argv, timeout=300)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["streams"] for r in records] == [1, 3]
    for r in records:
        assert r["open_connections"] is open_connections and r["client_processes"] == client_processes
        assert r["http"] == "httptools"  # a dependency: uvicorn runs on it, not on h11
        assert r["client_late_ms"] == 0.0 if client_processes == 1 else r["client_late_ms"] < 50
        assert r["all_tokens_delivered"] and r["text_matches_engine"]
        assert r["chunks_per_stream"] == 6  # one text chunk per token: the word tokenizer never holds text back
        rates = ("engine_tok_s", "async_tok_s", "sse_tok_s", "engine_steady_tok_s", "sse_steady_tok_s")
        assert all(math.isfinite(r[k]) for k in rates) and r["engine_tok_s"] > 0 and r["sse_tok_s"] > 0
        assert r["sse_steady_vs_engine"] == pytest.approx(r["sse_steady_tok_s"] / r["engine_steady_tok_s"])
