"""`thinking.budget_tokens` on /v1/messages is enforced (issue 59): the demo model, with its template ending the
prompt inside `<think>` (as Qwen3.5's does), reasons until the budget, then the answer follows in a text block."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.api.harness import RunningServer

USER = [{"role": "user", "content": "plan a trip"}]


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[RunningServer]:
    from server.api.app import create_app
    from server.config import EngineConfig, ServerConfig
    from server.engine.async_engine import AsyncEngine
    from tests.api.harness import run_app

    engine = AsyncEngine.from_config(EngineConfig.from_flat(model="demo", device="cpu"))
    tokenizer = engine.engine.tokenizer
    # thinking on: the prompt ends with "<think>\n"; off: with the closed empty block, as before
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
        "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}{{- '<think>\\n' }}\n    {%- endif %}")
    assert "{%- else %}{{- '<think>\\n' }}" in tokenizer.chat_template
    with run_app(create_app(engine, ServerConfig(served_model_name="demo")), engine) as running:
        yield running


def _thinking(server: RunningServer, budget: int, max_tokens: int) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    return client.messages.create(model="demo", max_tokens=max_tokens, messages=USER, extra_body={"temperature": 0.0},
                                  thinking={"type": "enabled", "budget_tokens": budget})


def test_budget_tokens_ends_the_reasoning_and_the_answer_follows(thinking_server: RunningServer) -> None:
    longer = _thinking(thinking_server, 1100, 1101)  # greedy: the same reasoning, cut later
    out = _thinking(thinking_server, 1024, 1040)
    assert [b.type for b in out.content] == ["thinking", "text"], out.content
    reasoning, answer = out.content[0].thinking, out.content[1].text
    assert answer.strip()
    # the same greedy reasoning, cut 76 tokens later: the budget, not the model, ended it
    assert [b.type for b in longer.content] == ["thinking"]
    assert longer.content[0].thinking.startswith(reasoning) and len(longer.content[0].thinking) > len(reasoning)
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 1040
