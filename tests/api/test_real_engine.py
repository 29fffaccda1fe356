"""The openai client against a real uvicorn serving the demo model through AsyncEngine (CPU).

The reference is a second, independent `Engine` on the same checkpoint, called through the Python API one
request at a time: whatever the HTTP layer adds (templates, streaming, batching with other clients) must not
change a greedy answer.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from tests.api.harness import RunningServer, run_app, wait_until

pytestmark = pytest.mark.slow
WORDS = "the small model wakes up on a fresh machine and writes its own weights before it answers".split()


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[RunningServer, object]]:
    from server.engine.async_engine import AsyncEngine
    from server.engine.engine import Engine

    config = EngineConfig.from_flat(model="demo", device="cpu")
    engine = AsyncEngine.from_config(config)
    reference = Engine.from_config(config)
    with run_app(create_app(engine, ServerConfig(served_model_name="demo")), engine) as running:
        yield running, reference


def _prompt(rng: random.Random, num_words: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _greedy(max_tokens: int = 24):
    from server.engine.types import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_chat_streaming_and_not_match_the_python_api(real) -> None:
    running, reference = real
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": _prompt(random.Random())}]
    expected = reference.chat(messages, _greedy())
    client = running.client()
    out = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.usage.completion_tokens == expected.completion_tokens
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == expected.completion_tokens
    # the same conversation again reuses its prompt's KV blocks
    again = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == expected.text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_streaming_and_not_match_the_python_api(real) -> None:
    running, reference = real
    prompt = _prompt(random.Random())
    expected = reference.generate(prompt, _greedy(16))
    client = running.client()
    out = client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == expected.text and out.usage.completion_tokens == expected.completion_tokens
    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_sixteen_concurrent_greedy_streams_give_their_solo_text(real) -> None:
    running, reference = real
    rng = random.Random()
    prompts = [_prompt(rng, rng.randint(3, 30)) for _ in range(16)]
    solo = [reference.generate(p, _greedy(32)).text for p in prompts]

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(stream_all()) == solo


def _gauge(running: RunningServer, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", running.metrics(), re.MULTILINE).group(1))


def test_disconnect_frees_the_request_and_its_kv_blocks(real) -> None:
    running, _ = real
    body = {"model": "demo", "prompt": _prompt(random.Random(), 40), "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert _gauge(running, "mps_serve_num_requests_running") == 1
        assert _gauge(running, "mps_serve_kv_blocks_used") > 0
    wait_until(lambda: _gauge(running, "mps_serve_num_requests_running") == 0, timeout_s=30)
    wait_until(lambda: _gauge(running, "mps_serve_kv_blocks_used") == 0, timeout_s=30)
    metrics = running.metrics()
    assert re.search(r'^mps_serve_requests_finished_total\{finish_reason="abort"\} [1-9]', metrics, re.MULTILINE)


def test_context_length_exceeded_from_the_engine(real) -> None:
    running, _ = real
    with pytest.raises(openai.BadRequestError) as info:
        running.client().completions.create(model="demo", prompt="word " * 5000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in info.value.message
