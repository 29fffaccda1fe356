"""Every client mistake is a 4xx in OpenAI's error shape; engine failures mid-stream are one error event."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.api.app import create_app
from server.config import ServerConfig
from server.engine.types import QueueFullError
from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, run_app, serve, sse_events

MSG = [{"role": "user", "content": "hi"}]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "max_completion_tokens": -2}, "max_completion_tokens"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "9" * 5000}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({}, "messages"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]},
     "tools[0].function.parameters"),
    ({"messages": MSG, "stream": True,
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]},
     "tools[0].function.parameters"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}},
                                 {"type": "function", "function": {"name": "g", "parameters": {"properties": [1]}}}]},
     "tools[1].function.parameters"),
])
def test_invalid_chat_parameters_are_400(srv: RunningServer, body: dict, param: str) -> None:
    err = _error(srv.post("/v1/chat/completions", body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param.startswith("messages[0].content"):
        assert "image" in err["message"]


def test_invalid_completion_parameters_are_400(srv: RunningServer) -> None:
    for body, param in (({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": []}, "prompt"),
                        ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "echo": True, "logprobs": 1}, "echo")):
        err = _error(srv.post("/v1/completions", body), 400)
        assert param is None or err["param"] == param


def test_malformed_json_and_non_object_bodies(srv: RunningServer) -> None:
    huge_int = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}"
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b"", huge_int):
        r = httpx.post(f"{srv.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert "detail" not in r.json()
        assert _error(r, 400)["code"] == "invalid_json"


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "\ud800"]}', "prompt[1]"),
    ("/v1/completions", r'{"prompt": "x", "stop": {"\ud800": 1}}', "stop"),
])
def test_lone_surrogates_are_400(srv: RunningServer, path: str, raw: str, param: str) -> None:
    r = httpx.post(f"{srv.url}{path}", content=raw.encode(), headers={"content-type": "application/json"})
    err = _error(r, 400)
    assert err["param"] == param and err["code"] == "invalid_unicode"


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _deep_arguments_call(arguments: str) -> dict:
    return {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested_schema(300)}}]},
     "tools[0].function.parameters"),
    ({"messages": MSG, "chat_template_kwargs": {"x": _nested_schema(300)}}, "chat_template_kwargs"),
    ({"messages": [_deep_arguments_call(json.dumps(_nested_schema(300))), *MSG]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [_deep_arguments_call("[" * 100_000), *MSG]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": _nested_schema(300)}]}]},
     "messages[0].content"),
])
def test_deep_nesting_is_400(srv: RunningServer, body: dict, param: str) -> None:
    assert _error(srv.post("/v1/chat/completions", body), 400)["param"] == param


def test_real_tool_schemas_nest_freely(srv: RunningServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested_schema(25)}}]
    r = srv.post("/v1/chat/completions", {"messages": MSG, "tools": tools, "chat_template_kwargs": {"x": [[[[1]]]]}})
    assert r.status_code == 200, r.text


def test_context_length_exceeded(srv: RunningServer) -> None:
    long_text = "word " * (srv.engine.max_model_len + 5)
    err = _error(srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"maximum context length is {srv.engine.max_model_len} tokens" in err["message"]
    err = _error(srv.post("/v1/completions", {"prompt": long_text}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        srv.client().chat.completions.create(model="m", messages=[{"role": "user", "content": long_text}])
    assert info.value.code == "context_length_exceeded"


def test_unknown_route_and_wrong_method(srv: RunningServer) -> None:
    assert "Invalid URL" in _error(srv.post("/v1/nope", {}), 404)["message"]
    assert _error(srv.get("/nothing/here"), 404)
    r = srv.get("/v1/chat/completions")
    _error(r, 405)
    assert "POST" in r.headers.get("allow", "")
    assert _error(srv.get("/v1/models/not-served"), 404)["code"] == "model_not_found"


def test_oversize_body_is_413() -> None:
    with serve(FakeEngine(), max_request_body_bytes=2000) as running:
        big = {"messages": [{"role": "user", "content": "x" * 3000}]}
        assert _error(running.post("/v1/chat/completions", big), 413)["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield json.dumps(big).encode()

        r = httpx.post(f"{running.url}/v1/chat/completions", content=chunked(), timeout=30)
        assert _error(r, 413)["code"] == "request_too_large"
        assert running.post("/v1/chat/completions", {"messages": MSG}).status_code == 200


def test_queue_full_is_429_with_retry_after(srv: RunningServer) -> None:
    srv.engine.submit_error = QueueFullError(300, retry_after_s=2.5)
    r = srv.post("/v1/chat/completions", {"messages": MSG})
    assert _error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "3"
    srv.engine.submit_error = None
    srv.engine.num_waiting = 10_000  # over config.max_waiting_requests: refused before reaching the engine
    n = len(srv.engine.submitted)
    r = srv.post("/v1/completions", {"prompt": "x"})
    assert _error(r, 429) and r.headers["retry-after"] and len(srv.engine.submitted) == n


@pytest.mark.parametrize("error_after", [0, 2])
def test_error_mid_stream_is_one_error_event_and_the_stream_closes(srv: RunningServer, error_after: int) -> None:
    srv.engine.script = Script(pieces=["a", "b", "c"], error_after=error_after)
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
        r = srv.post(path, {**body, "stream": True})
        data, _ = sse_events(r)
        assert "[DONE]" not in data
        events = [json.loads(d) for d in data]
        assert [set(e) for e in events].count({"error"}) == 1
        assert set(events[-1]) == {"error"} and events[-1]["error"]["type"] == "server_error"
        with pytest.raises(openai.APIError):
            list(srv.client().completions.create(model="m", prompt="x", stream=True))
        r = srv.post(path, body)  # non-streaming: a 500, not a hang
        assert _error(r, 500)["type"] == "server_error"


def test_health_is_503_and_requests_wait_while_loading() -> None:
    with run_app(create_app(None, ServerConfig(), model_name="some/model")) as running:
        assert _error(running.get("/health"), 503)["code"] == "model_loading"
        r = running.post("/v1/chat/completions", {"messages": MSG})
        assert _error(r, 503)["code"] == "model_loading" and r.headers["retry-after"]
        assert running.get("/v1/models").json()["data"][0]["id"] == "some/model"
        assert "mps_serve_model_loaded 0.0" in running.metrics()


@pytest.mark.parametrize("value", [5, 2.5, True, None, "text"])
def test_json_checks_accept_scalars(value) -> None:
    """Tool-call arguments may parse to a scalar: nothing to walk, and no 500."""
    from server.api.json_checks import check_json_body

    check_json_body(value, "messages[1].tool_calls[0].function.arguments")


def test_json_checks_name_a_lone_surrogate_in_a_scalar_string() -> None:
    from server.api.errors import APIError
    from server.api.json_checks import check_json_body

    with pytest.raises(APIError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments contains a lone"):
        check_json_body("\ud800", "messages[1].tool_calls[0].function.arguments")
