"""Raw SSE, parsed line by line as Zed and Continue do, against every framing rule of openai-wire.md."""

from __future__ import annotations

import json
import random
import threading

import httpx

from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, chunks_of, serve, sse_events
from tests.api.tool_markup import TOOLS, hermes, random_args

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _check_chat_chunks(chunks: list[dict], include_usage: bool) -> list[dict]:
    """Common rules; returns the choice chunks."""
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1 and isinstance(chunks[0]["created"], int)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-served" for c in chunks)
    choice_chunks = [c for c in chunks if c["choices"]]
    for c in choice_chunks:
        (choice,) = c["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
        assert ("usage" in c) == include_usage and (c.get("usage") is None)
    assert choice_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = choice_chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length", "tool_calls")
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    usage_chunks = [c for c in chunks if not c["choices"]]
    if include_usage:
        assert usage_chunks == [chunks[-1]] and chunks[-1]["usage"]["total_tokens"] > 0
        assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    else:
        assert usage_chunks == []
    return choice_chunks


def test_chat_stream_framing(srv: RunningServer) -> None:
    pieces = ["line one\n", "line \"two\"", "\n\n", "{json: [1]}", "é😀"]
    srv.engine.script = Script(pieces=pieces)
    for include_usage in (True, False):
        r = srv.post("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": include_usage}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data, _ = sse_events(r)
        chunks = chunks_of(data)
        choice_chunks = _check_chat_chunks(chunks, include_usage)
        content = [c["choices"][0]["delta"].get("content") for c in choice_chunks[1:-1]]
        assert "".join(content) == "".join(pieces) and all(content)


def test_completion_stream_framing(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["a\n", "b"])
    r = srv.post("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    chunks = chunks_of(sse_events(r)[0])
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a\n", "b", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"] == []
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 2


def test_tool_call_stream_framing(srv: RunningServer) -> None:
    args = random_args(random.Random())
    text = hermes("get_weather", args)
    srv.engine.script = Script(pieces=list(text))  # one character per delta
    r = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS, "stream_options": {"include_usage": True}})
    choice_chunks = _check_chat_chunks(chunks_of(sse_events(r)[0]), include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in choice_chunks[1:-1]]
    assert all(set(d) == {"tool_calls"} for d in deltas), "no content may leak from tool markup"
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    rest = [d["tool_calls"][0] for d in deltas[1:]]
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in rest)
    assert all(isinstance(f["function"]["arguments"], str) for f in rest)
    assert json.loads("".join(f["function"]["arguments"] for f in rest)) == args
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_keepalive_comments_while_waiting_for_the_first_token() -> None:
    gate = threading.Event()
    engine = FakeEngine(Script(pieces=["late"], gate=gate))
    with serve(engine, keepalive_interval_s=0.02) as running:
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=CHAT, timeout=30) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
            seen = []
            for line in lines:
                seen.append(line)
                if line == ": keepalive":
                    gate.set()  # the first token is released only once a keepalive was received
                if line == "data: [DONE]":
                    break
    assert ": keepalive" in seen
    data = [line[len("data: "):] for line in seen if line.startswith("data: ")]
    contents = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[:-1]]
    assert "late" in contents


def test_markup_split_at_every_point_through_the_server(srv: RunningServer) -> None:
    """Reasoning then a tool call, cut into two deltas at every position, over real SSE."""
    text = '<think>why</think>\n<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>'
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        for i in range(len(text) + 1):
            srv.engine.script = Script(pieces=[text[:i], text[i:]])
            r = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
            deltas = [c["choices"][0]["delta"] for c in chunks_of(sse_events(r)[0])]
            assert "".join(d.get("content") or "" for d in deltas) == "", f"split at {i}"
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == "why"
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            assert calls[0]["function"]["name"] == "get_weather"
            assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"days": 2}
