"""POST /v1/responses: the official openai client against a real uvicorn serving the scripted FakeEngine, the event
grammar with markup split at every position, and errors for malformed fields."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from server.api.responses_output import collect_response, stream_response
from tests.api.fake_engine import Script
from tests.api.harness import RunningServer, named_events
from tests.api.offline import run_offline
from tests.api.test_anthropic import _markup, _split
from tests.api.test_output_parsers import splits
from tests.api.tool_markup import TOOLS, hermes, random_args

R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ECHO = {"tools": R_TOOLS}


def fold(events: list[tuple[str, dict]]) -> dict:
    """Check the event grammar (order, indices, sequence numbers) and rebuild the response from the deltas."""
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and names.count(names[-1]) == 1
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    items: list[dict] = []
    open_item = None
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert open_item is None and data["output_index"] == len(items)
            open_item = dict(data["item"], text="", arguments="", parts=0)
            assert open_item["status"] == "in_progress"
            items.append(open_item)
            continue
        assert open_item is not None and data["output_index"] == len(items) - 1
        if name != "response.output_item.done":
            assert data["item_id"] == open_item["id"]
        if name == "response.content_part.added":
            assert open_item["type"] in ("message", "reasoning") and data["part"]["text"] == ""
            open_item["parts"] += 1
        elif name in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert open_item["parts"] == 1 and data["delta"]
            assert (open_item["type"] == "message") == (name == "response.output_text.delta")
            open_item["text"] += data["delta"]
        elif name in ("response.output_text.done", "response.reasoning_text.done"):
            assert data["text"] == open_item["text"]
        elif name == "response.content_part.done":
            assert data["part"]["text"] == open_item["text"]
        elif name == "response.function_call_arguments.delta":
            assert open_item["type"] == "function_call" and data["delta"]
            open_item["arguments"] += data["delta"]
        elif name == "response.function_call_arguments.done":
            assert data["arguments"] == open_item["arguments"] and data["name"] == open_item["name"]
        else:
            assert name == "response.output_item.done", name
            done = data["item"]
            assert done["id"] == open_item["id"] and done["status"] == "completed"
            if done["type"] == "function_call":
                assert done["arguments"] == open_item["arguments"]
            else:
                assert done["content"][0]["text"] == open_item["text"]
            items[-1], open_item = done, None
    assert open_item is None
    final = events[-1][1]["response"]
    assert final["output"] == items
    return final


def _shape(output: list[dict]) -> list[tuple]:
    out = []
    for item in output:
        if item["type"] == "function_call":
            assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
            out.append(("function_call", item["name"], json.loads(item["arguments"])))
        else:
            out.append((item["type"], item["content"][0]["type"], item["content"][0]["text"]))
    return out


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "pythonic"])
def test_event_sequence_with_markup_split_at_every_position(fmt: str) -> None:
    rng = random.Random()
    args = random_args(rng)
    text = "<think>\nPlan it.\n</think>\n\nChecking.\n" + _markup(fmt, args)
    expected = [("reasoning", "reasoning_text", "Plan it."), ("message", "output_text", "Checking."),
                ("function_call", "get_weather", args)]
    for pieces in splits(text, rng):
        events = named_events(run_offline(lambda ctx: stream_response(ctx, ECHO), pieces, stream=True, tools=TOOLS))
        final = fold(events)
        assert _shape(final["output"]) == expected and final["status"] == "completed"
        body = run_offline(lambda ctx: collect_response(ctx, ECHO), pieces, stream=False, tools=TOOLS)
        assert _shape(body["output"]) == expected and body["status"] == "completed"


def test_incomplete_and_usage() -> None:
    events = named_events(run_offline(lambda ctx: stream_response(ctx, ECHO), ["a", "b"], stream=True,
                                      finish_reason="length", cached_tokens=1))
    final = fold(events)
    assert events[-1][0] == "response.incomplete" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"] == {"input_tokens": 2, "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
                              "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 4}


def test_sdk_responses_create_streamed_and_not(srv: RunningServer) -> None:
    rng = random.Random()
    args = random_args(rng)
    srv.engine.script = Script(pieces=_split(f"<think>Why.</think>Sure. {hermes('get_weather', args)}", rng),
                               cached_tokens=2)
    client = srv.client()
    out = client.responses.create(model="anything", input="weather?", instructions="Be brief.", tools=R_TOOLS,
                                  max_output_tokens=500, temperature=0.4, top_p=0.8, store=False)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "fake-served"
    assert out.status == "completed" and out.output_text == "Sure." and out.instructions == "Be brief."
    assert [item.type for item in out.output] == ["reasoning", "message", "function_call"]
    assert out.output[0].content[0].text == "Why."
    assert out.output[2].name == "get_weather" and json.loads(out.output[2].arguments) == args
    _, prompt, params = srv.engine.submitted[-1]
    assert (params.max_tokens, params.temperature, params.top_p) == (500, 0.4, 0.8)
    assert out.usage.input_tokens == len(prompt.split()) and out.usage.input_tokens_details.cached_tokens == 2
    assert out.usage.output_tokens == len(srv.engine.script.pieces)
    assert srv.engine.rendered[-1]["messages"] == [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "weather?"}]
    with client.responses.stream(model="m", input="weather?", tools=R_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Sure." and json.loads(final.output[2].arguments) == args


def test_function_call_round_trip_renders_history(srv: RunningServer) -> None:
    args = random_args(random.Random())
    srv.engine.script = Script(pieces=["It is sunny."])
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(args)},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rainy"},
    ]
    out = srv.client().responses.create(model="m", input=history, tools=R_TOOLS)
    assert out.output_text == "It is sunny."
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]
    assert srv.engine.rendered[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls, "reasoning_content": "Call it."},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
    ]
    assert srv.engine.rendered[-1]["tools"] == [{"type": "function", "function": TOOLS[0]["function"]}]


def test_tool_choice_other_tools_and_reasoning_switch(srv: RunningServer) -> None:
    client = srv.client()
    tools = [*R_TOOLS, {"type": "function", "name": "other", "parameters": {"type": "object"}},
             {"type": "web_search"}]
    client.responses.create(model="m", input="q", tools=tools, tool_choice="none")
    assert srv.engine.rendered[-1]["tools"] is None
    client.responses.create(model="m", input="q", tools=tools, tool_choice={"type": "function", "name": "other"})
    assert [t["function"]["name"] for t in srv.engine.rendered[-1]["tools"]] == ["other"]
    client.responses.create(model="m", input="q", tools=tools, tool_choice="required")
    assert [t["function"]["name"] for t in srv.engine.rendered[-1]["tools"]] == ["get_weather", "other"]
    client.responses.create(model="m", input="q", reasoning={"effort": "none"})
    assert srv.engine.rendered[-1]["kwargs"] == {"enable_thinking": False}
    client.responses.create(model="m", input="q", reasoning={"effort": "high"})
    assert srv.engine.rendered[-1]["kwargs"] == {}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.message.role"),
    ({"input": [{"type": "mystery"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "input[0].function.arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.function_call.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.function_call_output.output"),
    ({"input": "q", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "q", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "q", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "q", "temperature": -1}, "temperature"),
    ({"input": "q", "top_p": 2}, "top_p"),
    ({"input": "q", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "q", "tools": [{"type": "function", "name": "f", "parameters": {"properties": 1}}]},
     "tools[0].parameters"),
    ({"input": "q", "tool_choice": "required"}, "tool_choice"),
    ({"input": "q", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "q", "tools": R_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_malformed_fields_are_400(srv: RunningServer, body: dict, param: str) -> None:
    num_submitted = len(srv.engine.submitted)
    for stream in (False, True):
        err = _error(srv.post("/v1/responses", {**body, "stream": stream}), 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"
    assert len(srv.engine.submitted) == num_submitted


def test_context_length_and_mid_stream_error(srv: RunningServer) -> None:
    err = _error(srv.post("/v1/responses", {"input": "w " * 5000}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    srv.engine.script = Script(pieces=["a", "b", "c"], error_after=1)
    events = named_events(srv.post("/v1/responses", {"input": "q", "stream": True}).text)
    assert events[-1][0] == "error" and "response.completed" not in [name for name, _ in events]
    assert events[-1][1]["message"] and events[-1][1]["sequence_number"] == len(events) - 1
    with pytest.raises(openai.InternalServerError):
        srv.client().responses.create(model="m", input="q")
