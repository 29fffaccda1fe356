"""POST /v1/messages and /count_tokens: the official anthropic client against a real uvicorn serving the scripted
FakeEngine, the event grammar with markup split at every position, and Anthropic-shaped errors."""

from __future__ import annotations

import json
import random

import anthropic
import httpx
import pytest

from server.api.anthropic_output import collect_message, stream_messages
from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, named_events, serve
from tests.api.offline import run_offline
from tests.api.test_output_parsers import splits
from tests.api.tool_markup import TOOLS, hermes, pythonic, qwen3_coder, random_args

A_TOOLS = [{"name": t["function"]["name"], "description": "weather", "input_schema": t["function"]["parameters"]}
           for t in TOOLS]
USER = [{"role": "user", "content": "weather in Paris?"}]


def _client(srv: RunningServer, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=api_key, max_retries=0, timeout=30)


def fold(events: list[tuple[str, dict]]) -> dict:
    """Check the event grammar and rebuild the message from it, as the SDK's accumulator does."""
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    message = events[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    blocks: list[dict] = []
    open_index = None
    for name, data in events[1:]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_index = data["index"]
            if blocks[-1]["type"] == "tool_use":
                assert blocks[-1]["input"] == {}
                blocks[-1]["partial"] = ""
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[delta["type"]]
            assert {"text": "text", "thinking": "thinking", "tool_use": "partial_json"}[block["type"]] == key
            assert delta[key]
            block["partial" if key == "partial_json" else key] += delta[key]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name == "message_delta":
            assert open_index is None
            message = {**message, **data["delta"], "usage": data["usage"]}
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial"))
    return {**message, "content": blocks}


def _markup(fmt: str, args: dict) -> str:
    if fmt == "qwen3_coder":
        args["city"] = args["city"].replace("\n", " ") or "x"
        return qwen3_coder("get_weather", args)
    return hermes("get_weather", args) if fmt == "hermes" else pythonic([("get_weather", args)])


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "pythonic"])
def test_event_sequence_with_markup_split_at_every_position(fmt: str) -> None:
    rng = random.Random()
    args = random_args(rng)
    text = "<think>\nPlan it.\n</think>\n\nChecking.\n" + _markup(fmt, args)
    expected = [{"type": "thinking", "thinking": "Plan it.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "name": "get_weather", "input": args}]
    for pieces in splits(text, rng):
        message = fold(named_events(run_offline(stream_messages, pieces, stream=True, tools=TOOLS)))
        assert [{k: v for k, v in b.items() if k != "id"} for b in message["content"]] == expected
        assert message["stop_reason"] == "tool_use" and message["content"][2]["id"].startswith("call_")
        body = run_offline(collect_message, pieces, stream=False, tools=TOOLS)
        assert [{k: v for k, v in b.items() if k != "id"} for b in body["content"]] == expected
        assert body["stop_reason"] == "tool_use"


def test_stop_reasons_and_usage() -> None:
    body = run_offline(collect_message, ["a", "b"], stream=False, cached_tokens=1)
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": 1, "output_tokens": 2, "cache_read_input_tokens": 1,
                             "cache_creation_input_tokens": 0}  # "a prompt": 2 tokens, 1 of them cached
    body = run_offline(collect_message, ["a", "b"], stream=False, stop_string="END")
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    body = run_offline(collect_message, ["a", "b"], stream=False, finish_reason="length")
    assert body["stop_reason"] == "max_tokens"
    events = named_events(run_offline(stream_messages, ["<think>", "x"], stream=True, finish_reason="length"))
    message = fold(events)  # thinking cut off by max_tokens: still a closed thinking block
    assert message["content"] == [{"type": "thinking", "thinking": "x", "signature": ""}]
    assert message["stop_reason"] == "max_tokens" and events[1][0] == "ping"


def test_sdk_messages_create_streamed_and_not(srv: RunningServer) -> None:
    rng = random.Random()
    args = random_args(rng)
    srv.engine.script = Script(pieces=_split(f"<think>Why.</think>Sure. {hermes('get_weather', args)}", rng),
                               cached_tokens=3)
    client = _client(srv)
    out = client.messages.create(model="anything", max_tokens=500, messages=USER, tools=A_TOOLS,
                                 stop_sequences=["STOP"], metadata={"user_id": "u1"},
                                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    assert out.id.startswith("msg_") and out.model == "fake-served" and out.role == "assistant"
    assert [b.type for b in out.content] == ["thinking", "text", "tool_use"]
    assert out.content[0].thinking == "Why." and out.content[1].text == "Sure."
    assert out.content[2].name == "get_weather" and out.content[2].input == args and out.stop_reason == "tool_use"
    _, prompt, params = srv.engine.submitted[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (500, 0.5, 0.9, 7, ["STOP"])
    assert out.usage.input_tokens == len(prompt.split()) - 3 and out.usage.cache_read_input_tokens == 3
    assert out.usage.output_tokens == len(srv.engine.script.pieces)
    with client.messages.stream(model="m", max_tokens=500, messages=USER, tools=A_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content[:2]] == [b.model_dump() for b in out.content[:2]]
    assert final.content[2].input == args and final.stop_reason == "tool_use"
    assert final.usage.cache_read_input_tokens == 3


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), len(text) // 4))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_tool_round_trip_renders_history(srv: RunningServer) -> None:
    args = random_args(random.Random())
    history = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "and tomorrow?"}]},
    ]
    srv.engine.script = Script(pieces=["It is sunny."])
    out = _client(srv).messages.create(model="m", max_tokens=20, system=[{"type": "text", "text": "Be brief."}],
                                       messages=history, tools=A_TOOLS)
    assert out.content[0].text == "It is sunny." and out.stop_reason == "end_turn"
    rendered = srv.engine.rendered[-1]
    assert rendered["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert rendered["tools"][0]["function"]["name"] == "get_weather"
    assert rendered["tools"][0]["function"]["parameters"] == TOOLS[0]["function"]["parameters"]


def test_tool_choice_and_thinking_switch(srv: RunningServer) -> None:
    client = _client(srv)
    two = [*A_TOOLS, {"name": "other", "input_schema": {"type": "object"}}]
    client.messages.create(model="m", max_tokens=5, messages=USER, tools=two, tool_choice={"type": "none"})
    assert srv.engine.rendered[-1]["tools"] is None
    client.messages.create(model="m", max_tokens=5, messages=USER, tools=two, tool_choice={"type": "tool", "name": "other"})
    assert [t["function"]["name"] for t in srv.engine.rendered[-1]["tools"]] == ["other"]
    client.messages.create(model="m", max_tokens=5, messages=USER, tools=two, tool_choice={"type": "any"})
    assert len(srv.engine.rendered[-1]["tools"]) == 2
    client.messages.create(model="m", max_tokens=5, messages=USER, thinking={"type": "disabled"})
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": False}
    srv.engine.script = Script(pieces=["Hmm.", "</think>", "Yes."])  # the template opened <think> in the prompt
    out = client.messages.create(model="m", max_tokens=2048, messages=USER,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": True}
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == \
        [("thinking", "Hmm."), ("text", "Yes.")]


def test_count_tokens(srv: RunningServer) -> None:
    num_submitted = len(srv.engine.submitted)
    count = _client(srv).messages.count_tokens(model="m", messages=USER, system="Be brief.")
    rendered = srv.engine.rendered[-1]
    prompt = srv.engine.render_chat(rendered["messages"], rendered["tools"])
    assert count.input_tokens == len(prompt.split()) and len(srv.engine.submitted) == num_submitted


def _anthropic_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type
    assert body["error"]["message"]
    return body["error"]["message"]


BASE = {"max_tokens": 10, "messages": USER}


@pytest.mark.parametrize("body, field", [
    ({"messages": USER}, "max_tokens"),
    ({**BASE, "max_tokens": 0}, "max_tokens"),
    ({**BASE, "max_tokens": "many"}, "max_tokens"),
    ({**BASE, "messages": []}, "messages"),
    ({**BASE, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
     "input"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({**BASE, "system": 3}, "system"),
    ({**BASE, "temperature": 1.5}, "temperature"),
    ({**BASE, "top_p": 0}, "top_p"),
    ({**BASE, "top_k": -5}, "top_k"),
    ({**BASE, "stop_sequences": "END"}, "stop_sequences"),
    ({**BASE, "tools": [{"name": "f"}]}, "input_schema"),
    ({**BASE, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
    ({**BASE, "tools": [{"name": "f", "input_schema": {"properties": 3}}]}, "tools[0].input_schema"),
    ({**BASE, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({**BASE, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({**BASE, "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({**BASE, "thinking": {"type": "maybe"}}, "thinking.type"),
])
def test_malformed_fields_are_anthropic_400s(srv: RunningServer, body: dict, field: str) -> None:
    num_submitted = len(srv.engine.submitted)
    for stream in (False, True):
        message = _anthropic_error(srv.post("/v1/messages", {**body, "stream": stream}), 400, "invalid_request_error")
        assert field in message
    assert len(srv.engine.submitted) == num_submitted


def test_request_level_errors(srv: RunningServer) -> None:
    assert "not valid JSON" in _anthropic_error(
        httpx.post(f"{srv.url}/v1/messages", content=b"{", timeout=30), 400, "invalid_request_error")
    long = [{"role": "user", "content": "w " * 5000}]
    assert "maximum context length" in _anthropic_error(
        srv.post("/v1/messages", {**BASE, "messages": long}), 400, "invalid_request_error")
    srv.engine.num_waiting = 10_000
    _anthropic_error(srv.post("/v1/messages", BASE), 429, "rate_limit_error")
    with pytest.raises(anthropic.RateLimitError):
        _client(srv).messages.create(model="m", **BASE)


def test_error_mid_stream_is_one_error_event(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["a", "b", "c"], error_after=1)
    events = named_events(srv.post("/v1/messages", {**BASE, "stream": True}).text)
    assert [name for name, _ in events][-1] == "error" and "message_stop" not in [name for name, _ in events]
    assert events[-1][1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError):
        list(_client(srv).messages.create(model="m", stream=True, **BASE))
    _anthropic_error(srv.post("/v1/messages", BASE), 500, "api_error")


def test_api_key_and_version_headers() -> None:
    with serve(FakeEngine(), api_key="s3cret") as running:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = running.post("/v1/messages", BASE, headers=headers)
            _anthropic_error(r, 401, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            _client(running, "wrong").messages.create(model="m", **BASE)
        ok = running.post("/v1/messages", BASE, headers={"x-api-key": "s3cret", "anthropic-version": "2023-06-01"})
        assert ok.status_code == 200 and ok.json()["type"] == "message"
        assert _client(running, "s3cret").messages.create(model="m", **BASE).content
        assert running.post("/v1/chat/completions", {"messages": USER}, headers={"x-api-key": "s3cret"}).status_code == 200
        assert running.post("/v1/chat/completions", {"messages": USER}).json()["error"]["code"] == "invalid_api_key"
