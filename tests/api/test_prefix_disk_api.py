"""The prefix cache's disk tier through the HTTP API, with the real clients against the demo model (CPU): a server
restarted on the same cache directory serves a conversation's prefix from disk, and every protocol's usage reports
those tokens as cached; /metrics splits memory hits, disk hits and misses. /v1/messages/count_tokens answers past
the context window."""

from __future__ import annotations

import re

import anthropic
import pytest

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from tests.api.harness import run_app, wait_until

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and check facts." for i in range(12))


def _engine(cache_dir, max_model_len: int = 512):
    from server.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(EngineConfig.from_flat(model="demo", device="cpu", max_model_len=max_model_len,
                                                          prefix_cache_dir=str(cache_dir)))


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_restart_serves_cached_tokens_from_disk_in_every_protocol(tmp_path):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is two plus two?"}]
    first = _engine(tmp_path)
    with run_app(create_app(first, ServerConfig()), first) as running:
        out = running.client().chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        prompt_tokens = out.usage.prompt_tokens
        # idle, the engine writes what memory caches, before any shutdown (a killed server loses little)
        wait_until(lambda: first.stats().prefix_cache_disk_bytes > 0)
    # and its shutdown wrote the rest; a new process on the same model reads them
    second = _engine(tmp_path)
    with run_app(create_app(second, ServerConfig()), second) as running:
        out = running.client().chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert cached == (prompt_tokens - 1) // 16 * 16 and cached >= 96
        metrics = running.metrics()
        assert _metric(metrics, 'mps_serve_prefix_cache_tokens_total{source="disk"}') == cached
        assert _metric(metrics, 'mps_serve_prefix_cache_tokens_total{source="miss"}') == prompt_tokens - cached
        assert _metric(metrics, "mps_serve_prefix_cache_disk_bytes") > 0

        client = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=60)
        message = client.messages.create(model="demo", system=SYSTEM, max_tokens=4,
                                         messages=[{"role": "user", "content": "What is two plus two?"}])
        assert message.usage.cache_read_input_tokens >= 96
        assert 0 < message.usage.input_tokens < 40  # what was computed: the tail after the shared system prompt

        response = running.client().responses.create(model="demo", instructions=SYSTEM, max_output_tokens=4,
                                                     input="What is two plus two?")
        assert response.usage.input_tokens_details.cached_tokens >= 96
        metrics = running.metrics()
        assert _metric(metrics, 'mps_serve_prefix_cache_tokens_total{source="memory"}') >= 192


def test_count_tokens_answers_past_the_context_window(tmp_path):
    engine = _engine(tmp_path, max_model_len=128)
    with run_app(create_app(engine, ServerConfig()), engine) as running:
        client = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0, timeout=60)

        def count(text: str) -> int:
            return client.messages.count_tokens(model="demo", messages=[{"role": "user", "content": text}]).input_tokens

        short, long = " ".join(["tokens"] * 20), " ".join(["tokens"] * 2000)
        message = client.messages.create(model="demo", max_tokens=1, messages=[{"role": "user", "content": short}])
        assert count(short) == message.usage.input_tokens + message.usage.cache_read_input_tokens
        # the template's tokens are the same in both: the difference is the text's
        encode = engine.engine.tokenizer.encode
        assert count(long) - count(short) == len(encode(long, add_special_tokens=False)) - len(
            encode(short, add_special_tokens=False))
        assert count(long) > 1000
        with pytest.raises(anthropic.BadRequestError, match="context"):  # generating from it is still refused
            client.messages.create(model="demo", max_tokens=1, messages=[{"role": "user", "content": long}])
