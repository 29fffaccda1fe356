"""Structured outputs on the agent protocols: Responses' text.format and tool_choice, Anthropic's tool_choice
"any" / "tool" with disable_parallel_tool_use, through the official clients against a demo_server uvicorn serving the
demo model (random weights: only the grammar makes its output JSON or a valid call)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.api.test_structured_api import OTHER, SCHEMA, TOOL

TOOLS = {t["function"]["name"]: t["function"] for t in (TOOL, OTHER)}
NO_REASONING = {"effort": "none"}
A_TOOLS = [{"name": name, "input_schema": f["parameters"]} for name, f in TOOLS.items()]
A_NO_THINKING = {"type": "disabled"}
USER = [{"role": "user", "content": "describe the weather"}]


def _anthropic(demo_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=demo_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_json_schema(demo_server, stream: bool) -> None:
    text = {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}}
    kw = dict(model="demo", input="describe the weather", text=text, max_output_tokens=60, reasoning=NO_REASONING)
    client = demo_server.client()
    if stream:
        with client.responses.stream(**kw) as events:
            out = events.get_final_response()
    else:
        out = client.responses.create(**kw)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema" and out.text.format.name == "w"
    any_object = client.responses.create(**{**kw, "text": {"format": {"type": "json_object"}}})
    assert any_object.output_text.startswith("{")  # any object: random weights may not close it in 60 tokens


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_responses_tool_choice_gives_one_valid_call(demo_server, tool_choice) -> None:
    tools = [{"type": "function", **f} for f in TOOLS.values()]
    out = demo_server.client().responses.create(model="demo", input="describe the weather", tools=tools,
                                         tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=80,
                                         reasoning=NO_REASONING)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1
    if isinstance(tool_choice, dict):
        assert calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[calls[0].name]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True},
                                         {"type": "tool", "name": "get_weather"}])
def test_messages_tool_choice_gives_one_valid_tool_use(demo_server, tool_choice, stream: bool) -> None:
    kw = dict(model="demo", max_tokens=80, messages=USER, tools=A_TOOLS, tool_choice=tool_choice,
              thinking=A_NO_THINKING)
    client = _anthropic(demo_server)
    if stream:
        with client.messages.stream(**kw) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kw)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    if tool_choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, TOOLS[uses[0].name]["parameters"])


def test_a_bad_schema_is_a_400_in_each_protocol_shape(demo_server) -> None:
    bad = {"type": "strin"}
    response = demo_server.post("/v1/responses", {"input": "q", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": bad}}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "text.format"
    assert "text.format cannot be enforced" in response.json()["error"]["message"]
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}
    response = demo_server.post("/v1/messages", {"max_tokens": 5, "messages": USER, "tools": [tool],
                                          "tool_choice": {"type": "any"}})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "tool_choice cannot be enforced" in body["error"]["message"]
