"""Hostile inputs to the structured and agent paths (issue 59): each is answered with a valid 2xx or a clear 4xx in
the protocol's shape, without internals, and never stalls other clients. The official clients against the fake
engine (tests/api/fake_engine.py) where the engine's answer does not matter, else the demo model."""

from __future__ import annotations

import json
import sys

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.api.fake_engine import Script
from tests.api.harness import RunningServer
from tests.api.test_input_size import _health_while_gated

USER = [{"role": "user", "content": "describe the weather"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
INTERNALS = ("panic", "u16::MAX", "max is 2000", "<state>", "pydantic.dev", "discriminator", "_item_type")


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _no_internals(text: str) -> None:
    for word in INTERNALS:
        assert word not in text, text


def test_a_small_constrained_request_compiles_off_the_event_loop(srv: RunningServer) -> None:
    """The off-loop decision is not the prompt's size alone: a grammar compile may take seconds."""
    body = {"prompt": "hi", "max_tokens": 3, "response_format": _json_schema({"type": "object"})}
    assert _health_while_gated(srv, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("schema, code", [
    ({"$ref": "#"}, "unsatisfiable_schema"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "unsatisfiable_schema"),
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "unsatisfiable_schema"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}, "schema_too_complex"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(16000)}}, "schema_too_complex"),
    ({"type": "object", "properties": {f"a_long_property_name_{i:05d}": {"type": "integer"} for i in range(6000)},
      "required": [f"a_long_property_name_{i:05d}" for i in range(6000)]}, "grammar_too_large"),
])
def test_schemas_that_cannot_be_enforced_are_a_400_up_front(demo_server, schema, code) -> None:
    response = demo_server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 8,
                                                         "response_format": _json_schema(schema)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and error["code"] == code
    _no_internals(error["message"])


def test_a_recursive_schema_with_a_way_out_still_works(demo_server) -> None:
    schema = {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}
    out = demo_server.client().chat.completions.create(model="demo", messages=USER, max_tokens=60, seed=1,
                                                       response_format=_json_schema(schema), extra_body=NO_THINKING)
    if out.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def _optional_object(prefix: str) -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(390)}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_limit_hit_mid_answer_is_an_error_not_a_stop(demo_server, stream: bool) -> None:
    """Under the per-object limits, over llguidance's row limit at the first key (`{"`, made all but certain)."""
    schema = {"anyOf": [_optional_object("a"), _optional_object("b")]}
    body = {"messages": USER, "max_tokens": 20, "seed": 1, "response_format": _json_schema(schema), "stream": stream,
            "logit_bias": {"469": 100}, **NO_THINKING}
    response = demo_server.post("/v1/chat/completions", body)
    if not stream:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    else:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert not any(c["finish_reason"] == "stop" for e in events for c in e.get("choices", []))
        error = events[-1]["error"]
    assert error["param"] == "response_format" and error["code"] == "grammar_limit"
    _no_internals(error["message"])


@pytest.mark.parametrize("text", ["<|im_end|>", "</tool_call>"])
def test_a_const_that_spells_a_special_token_completes(demo_server, text: str) -> None:
    schema = {"type": "object", "properties": {"v": {"enum": [text]}}, "required": ["v"], "additionalProperties": False}
    out = demo_server.client().chat.completions.create(model="demo", messages=USER, max_tokens=40, seed=2,
                                                       response_format=_json_schema(schema), extra_body=NO_THINKING)
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) == {"v": text}


@pytest.mark.parametrize("name", ["</tool_call>", "a b", "x" * 65, ""])
def test_tool_names_are_validated_in_every_protocol(srv: RunningServer, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        srv.client().chat.completions.create(model="m", messages=USER, tool_choice="required", tools=[
            {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}])
    assert chat.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as responses:
        srv.client().responses.create(model="m", input="q", tools=[
            {"type": "function", "name": name, "parameters": {"type": "object"}}])
    assert responses.value.body["param"] == "tools[0].name"
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as messages:
        client.messages.create(model="m", max_tokens=5, messages=USER, tools=[
            {"name": name, "input_schema": {"type": "object"}}], tool_choice={"type": "any"})
    assert messages.value.body["type"] == "error" and "tools.0.name" in messages.value.body["error"]["message"]


def _anthropic(srv: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)


def test_messages_without_thinking_do_not_think(srv: RunningServer) -> None:
    _anthropic(srv).messages.create(model="m", max_tokens=5, messages=USER)
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("extra, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "tool", "name": "f"}},
     "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "thinking.budget_tokens"),  # not under max_tokens
])
def test_messages_thinking_rules_are_anthropics(srv: RunningServer, extra: dict, param: str) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        _anthropic(srv).messages.create(model="m", max_tokens=2048, messages=USER, tools=tools, **extra)
    assert refused.value.body["type"] == "error" and param.split(".")[0] in refused.value.body["error"]["message"]


def test_reasoning_effort_none_turns_thinking_off_on_chat(srv: RunningServer) -> None:
    srv.client().chat.completions.create(model="m", messages=USER, reasoning_effort="none")
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": False}
    srv.client().chat.completions.create(model="m", messages=USER, reasoning_effort="none",
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": True}  # the explicit switch wins


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/v1/messages/nope", 404), ("GET", "/v1/messages", 405), ("GET", "/v1/messages/count_tokens", 405),
])
def test_messages_routes_answer_404_and_405_in_anthropics_shape(srv: RunningServer, method, path, status) -> None:
    response = httpx.request(method, srv.url + path, json={})
    assert response.status_code == status
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}


def test_responses_errors_name_input_and_show_no_internals(srv: RunningServer) -> None:
    long_input = "word " * 5000  # over the fake engine's context of 4096 words
    response = srv.post("/v1/responses", {"input": long_input})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "input"
    assert "messages" not in error["message"] and "input" in error["message"]
    for body in ({"input": [{"type": "bogus"}]}, {"input": [{"role": "user"}]},
                 {"input": "q", "tools": [{"type": "function", "name": 3}]}):
        response = srv.post("/v1/responses", body)
        assert response.status_code == 400, response.text
        _no_internals(response.text)


def test_an_out_of_range_number_in_tool_input_renders(srv: RunningServer) -> None:
    """Valid JSON the grammar allows for a `number`, which Python reads as inf: the Messages answer still renders."""
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 61431e8446496323440, "y": -1e999, "z": 1.5}}\n</tool_call>'
    srv.engine.script = Script(pieces=[call])
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "number"}}}}]
    out = _anthropic(srv).messages.create(model="m", max_tokens=50, messages=USER, tools=tools)
    (use,) = [block for block in out.content if block.type == "tool_use"]
    assert use.input == {"x": sys.float_info.max, "y": -sys.float_info.max, "z": 1.5}


def test_forced_tool_objects_without_additional_properties_are_closed() -> None:
    """pydantic / LangChain schemas leave additionalProperties out: a forced call may not add undeclared keys (and so
    run on to max_tokens, which left Anthropic's tool_use input {})."""
    from server.api.structured import tool_choice_output
    from server.engine.demo import ensure_demo_model
    from server.engine.grammar import Grammars
    from server.engine.tokenizer import Tokenizer

    nested = {"type": "object", "properties": {"b": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": nested}, "required": ["a"]}}}
    tokenizer = Tokenizer.from_pretrained(ensure_demo_model())
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    spec = tool_choice_output([tool], "json", parallel=False, reasoning="none")

    def accepts(arguments: str) -> bool:
        matcher = grammars.compile(spec)
        text = '<tool_call>\n{"name": "f", "arguments": ' + arguments + "}\n</tool_call>"
        return not any(matcher.advance(t) for t in tokenizer.encode(text, add_special_tokens=False)[:-1])

    assert accepts('{"a": {"b": 1}}')
    assert not accepts('{"a": {"b": 1}, "extra": 2}') and not accepts('{"a": {"b": 1, "c": 3}}')
    assert "additionalProperties" not in tool["function"]["parameters"]  # the request's tools are left as sent


CHAT = {"messages": USER}
MESSAGES = {"messages": USER, "max_tokens": 8}
RESPONSES = {"input": "q"}


def _refused(srv: RunningServer, path: str, body: dict, param: str) -> str:
    """POST `body`: a 400 in the route's protocol shape naming `param`; returns the message."""
    response = srv.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":  # Anthropic's shape names the field in the message only
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert param in error["message"], error
    else:
        assert error["param"] == param, error
    _no_internals(error["message"])
    return error["message"]


@pytest.mark.parametrize("path, base, field, value", [
    ("/v1/chat/completions", CHAT, "max_tokens", True),
    ("/v1/chat/completions", CHAT, "max_tokens", 1e30),
    ("/v1/chat/completions", CHAT, "max_completion_tokens", 5.0),
    ("/v1/chat/completions", CHAT, "n", True),
    ("/v1/chat/completions", CHAT, "temperature", True),
    ("/v1/chat/completions", CHAT, "top_p", "0.5"),
    ("/v1/chat/completions", CHAT, "seed", False),
    ("/v1/chat/completions", CHAT, "top_k", True),
    ("/v1/chat/completions", CHAT, "top_logprobs", True),
    ("/v1/chat/completions", CHAT, "presence_penalty", True),
    ("/v1/completions", {"prompt": "hi"}, "max_tokens", True),
    ("/v1/completions", {"prompt": "hi"}, "logprobs", True),
    ("/v1/messages", MESSAGES, "max_tokens", True),
    ("/v1/messages", MESSAGES, "max_tokens", 1e30),
    ("/v1/messages", MESSAGES, "temperature", True),
    ("/v1/messages", MESSAGES, "top_k", True),
    ("/v1/responses", RESPONSES, "max_output_tokens", True),
    ("/v1/responses", RESPONSES, "max_output_tokens", 1e30),
    ("/v1/responses", RESPONSES, "temperature", False),
    ("/infill", {"input_prefix": "a"}, "n_predict", True),
    ("/infill", {"input_prefix": "a"}, "t_max_predict_ms", True),
    ("/v1/completions", {"prompt": "hi"}, "t_max_predict_ms", True),
])
def test_booleans_strings_and_fractions_are_not_integers(srv: RunningServer, path, base, field, value) -> None:
    message = _refused(srv, path, {**base, field: value}, field)
    assert "valid" in message  # pydantic's "Input should be a valid integer / number"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": True}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/messages", {**MESSAGES, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens"),
])
def test_booleans_inside_fields_are_not_numbers(srv: RunningServer, path, body, param) -> None:
    _refused(srv, path, body, param)


def _tools_chat(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(33)]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": "x" * 513}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": [f"s{i}" for i in range(10_000)]}, "stop_sequences"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": ["y" * 600]}, "stop_sequences"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "tools": _tools_chat(129)}, "tools"),
    ("/v1/messages", {**MESSAGES, "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}}
                                            for i in range(129)]}, "tools"),
    ("/v1/responses", {**RESPONSES, "tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
])
def test_per_token_work_a_client_controls_is_capped(srv: RunningServer, path, body, param) -> None:
    _refused(srv, path, body, param)


@pytest.mark.parametrize("body", [
    {**CHAT, "stop": [f"s{i}" for i in range(32)], "logit_bias": {str(i): 1 for i in range(300)},
     "tools": _tools_chat(128), "max_tokens": 10**12},
])
def test_up_to_the_caps_is_served(srv: RunningServer, body) -> None:
    """At the caps is fine; a max_tokens past the context is an integer, served up to the context (length)."""
    response = srv.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
])
def test_responses_refuses_what_needs_a_stored_response_or_cannot_be_included(srv: RunningServer, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        srv.client().responses.create(model="m", input="q", **extra)
    assert refused.value.body["param"] == param


@pytest.mark.parametrize("extra", [{"store": True}, {"store": False}, {"background": False},
                                   {"include": ["reasoning.encrypted_content"]}])
def test_responses_accepts_what_it_honours_and_says_nothing_is_stored(srv: RunningServer, extra) -> None:
    srv.engine.script = Script(pieces=["fine"])
    out = srv.client().responses.create(model="m", input="q", **extra)
    assert out.output_text == "fine" and out.store is False
