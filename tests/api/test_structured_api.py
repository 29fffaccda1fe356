"""response_format and enforced tool_choice over HTTP: the official openai client against a real uvicorn serving
the demo model (random weights: only the grammar makes its output JSON), and the tool-call grammars of every
format checked against the markup their parsers read."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from server.api.chat_output import ChatOutputParser, MessageBuilder
from server.api.structured import tool_call_format, tool_choice_output
from tests.api.tool_markup import hermes, qwen3_coder

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "describe the weather"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "unit": {"enum": ["C", "F"]},
        "alert": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["C", "F"]
    days: list[int] = Field(max_length=2)


def test_openai_parse_with_a_pydantic_model(demo_server) -> None:
    completion = demo_server.client().chat.completions.parse(model="demo", messages=MESSAGES, response_format=Forecast,
                                                      max_tokens=60, seed=3, extra_body=NO_THINKING)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert choice.message.parsed.unit in ("C", "F")


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_chat_with_n_choices(demo_server, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    kw = dict(model="demo", messages=MESSAGES, response_format=response_format, max_tokens=60, n=2, seed=11,
              extra_body=NO_THINKING)
    client = demo_server.client()
    if stream:
        texts = ["", ""]
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_on_completions_and_a_stop_string_inside(demo_server) -> None:
    client = demo_server.client()
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    out = client.completions.create(model="demo", prompt="weather:", max_tokens=40, seed=2, extra_body=body)
    assert out.choices[0].finish_reason == "stop"
    text = out.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    cut = client.completions.create(model="demo", prompt="weather:", max_tokens=40, seed=2, stop=['"days"'],
                                    extra_body=body)
    assert cut.choices[0].text == text[: text.index('"days"')]
    any_object = client.completions.create(model="demo", prompt="weather:", max_tokens=40, seed=2,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert any_object.choices[0].text.startswith("{")


def test_a_schema_longer_than_max_tokens_ends_with_length(demo_server) -> None:
    out = demo_server.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, seed=1,
                                                response_format={"type": "json_schema", "json_schema": {
                                                    "name": "w", "schema": SCHEMA}}, extra_body=NO_THINKING)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_enforced_tool_choice_gives_one_valid_call(demo_server, tool_choice) -> None:
    out = demo_server.client().chat.completions.create(model="demo", messages=MESSAGES, tools=[TOOL, OTHER], max_tokens=80,
                                                tool_choice=tool_choice, parallel_tool_calls=False, seed=4,
                                                extra_body=NO_THINKING)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1
    tool = {t["function"]["name"]: t["function"] for t in (TOOL, OTHER)}[calls[0].function.name]
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["parameters"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_an_unsupported_constraint_is_a_400_naming_the_param(demo_server, body, param) -> None:
    response = demo_server.post("/v1/chat/completions", {"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


ARGS = {"city": "Oslo", "days": [1, 2], "unit": "C", "alert": None}
XML_ARGS = {k: v for k, v in ARGS.items() if k != "alert"}
MARKUP = {  # (a call as the model writes it, what the rendered prompt shows of the format)
    "json": (hermes("get_weather", ARGS), "<tools>"),
    "xml": (qwen3_coder("get_weather", XML_ARGS), "<function=example>"),
    "pythonic": ('<|tool_call_start|>[get_weather(city="Oslo", days=[1, 2], unit="C")]<|tool_call_end|>',
                 "<|tool_list_start|>"),
}


@pytest.mark.parametrize("fmt", sorted(MARKUP))
def test_tool_call_grammars_accept_the_markup_their_parsers_read(fmt: str) -> None:
    from server.engine.demo import ensure_demo_model
    from server.engine.grammar import Grammars
    from server.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(ensure_demo_model())
    markup, prompt_hint = MARKUP[fmt]
    assert tool_call_format(f"system {prompt_hint}") == fmt
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    spec = tool_choice_output([TOOL], fmt, parallel=False, reasoning="none")
    matcher = grammars.compile(spec)
    ids = tokenizer.encode(markup, add_special_tokens=False)
    assert not any(matcher.advance(t) for t in ids[:-1])
    assert matcher.advance(ids[-1])  # complete exactly at the end of the call
    parser = ChatOutputParser(start_in_reasoning=False, tools=[TOOL])
    builder = MessageBuilder("reasoning_content")
    builder.add(parser.feed(markup) + parser.finish())
    (call,) = builder.message()["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == (ARGS if fmt == "json" else XML_ARGS)
    refused = grammars.compile(spec)  # an enum value outside the schema ends the matcher early
    assert any(refused.advance(t) for t in tokenizer.encode(markup.replace("C", "K", 1), add_special_tokens=False))
