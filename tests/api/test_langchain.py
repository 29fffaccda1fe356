"""LangChain's `with_structured_output` against the server, in each of its methods: the constraint is what makes
the demo model's random weights answer with the schema's object (json_schema, the default, and json_mode) or
with a call of the bound tool (function_calling)."""

from __future__ import annotations

import langchain_openai
import pytest

from tests.api.test_structured_api import NO_THINKING, Forecast

PROMPT = "describe the weather, as JSON"


def _chat(demo_server):
    return langchain_openai.ChatOpenAI(
        model="demo", base_url=f"{demo_server.url}/v1", api_key="unused", max_retries=0, timeout=60,
        max_tokens=200, seed=5, extra_body=NO_THINKING)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_gives_the_pydantic_model(demo_server, method: str) -> None:
    result = _chat(demo_server).with_structured_output(Forecast, method=method).invoke(PROMPT)
    assert isinstance(result, Forecast)
    assert result.unit in ("C", "F") and len(result.city) <= 8 and len(result.days) <= 2


def test_json_mode_gives_a_json_object(demo_server) -> None:
    result = _chat(demo_server).with_structured_output(method="json_mode").invoke(PROMPT)
    assert isinstance(result, dict)


def test_include_raw_keeps_the_tool_call(demo_server) -> None:
    out = _chat(demo_server).with_structured_output(Forecast, method="function_calling", include_raw=True).invoke(
        PROMPT)
    assert out["parsing_error"] is None
    (call,) = out["raw"].tool_calls
    assert call["name"] == "Forecast"
    assert Forecast(**call["args"]) == out["parsed"]
