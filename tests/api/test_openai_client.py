"""The official openai client against a real uvicorn serving the scripted FakeEngine."""

from __future__ import annotations

import json
import random

from server.engine.types import SamplingParams
from tests.api.fake_engine import Script
from tests.api.harness import RunningServer
from tests.api.tool_markup import TOOLS, hermes, pythonic, qwen3_coder, random_args


def _pieces(rng: random.Random, n: int = 8) -> list[str]:
    return [rng.choice(["Hel", "lo", " wör", "ld", " 😀", "\n", " a", "\"q\""]) for _ in range(n)]


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3)))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_chat_non_streaming(srv: RunningServer) -> None:
    rng = random.Random()
    srv.engine.script = Script(pieces=_pieces(rng), cached_tokens=2)
    out = srv.client().chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi you"}])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "fake-served"
    assert out.choices[0].message.content == "".join(srv.engine.script.pieces)
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "stop"
    rid, prompt, _ = srv.engine.submitted[-1]
    assert out.usage.prompt_tokens == len(prompt.split())
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    assert out.system_fingerprint


def test_chat_streaming(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=_pieces(random.Random()))
    stream = srv.client().chat.completions.create(
        model="fake-served", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(srv.engine.script.pieces)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_completions_streaming_and_not(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=_pieces(random.Random()))
    client = srv.client()
    out = client.completions.create(model="alias-a", prompt="once upon a time", max_tokens=5)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == "".join(srv.engine.script.pieces[:5]) and out.choices[0].finish_reason == "length"
    assert srv.engine.submitted[-1][1] == "once upon a time" and srv.engine.submitted[-1][2].max_tokens == 5
    chunks = list(client.completions.create(model="x", prompt=[1, 2, 3], stream=True, max_tokens=50))
    assert "".join(c.choices[0].text for c in chunks) == "".join(srv.engine.script.pieces)
    assert srv.engine.submitted[-1][1] == [1, 2, 3]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_params_mapping(srv: RunningServer) -> None:
    srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7, "max_tokens": 99,
        "temperature": 0.3, "top_p": 0.9, "stop": ["a", "", "b", "c", "d", "e", "f"], "seed": 11,
        "logit_bias": {"42": -3, "7": 2.5}, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "logprobs": True,
        "top_logprobs": 3, "prompt_cache_key": "ignored", "reasoning_effort": "high", "unknown_field": [1],
    }).raise_for_status()
    params = srv.engine.submitted[-1][2]
    assert params == SamplingParams(
        max_tokens=7, temperature=0.3, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={42: -3.0, 7: 2.5},
        stop=["a", "b", "c", "d", "e", "f"], seed=11, logprobs=3, ignore_eos=True,
    )
    srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": "end"})
    params = srv.engine.submitted[-1][2]
    assert params.stop == ["end"] and params.max_tokens == srv.engine.max_model_len and params.logprobs is None
    srv.post("/v1/completions", {"prompt": "x", "stop": [""], "logprobs": 0}).raise_for_status()
    params = srv.engine.submitted[-1][2]
    assert params.stop == [] and params.max_tokens == 16 and params.logprobs == 0


def test_messages_reach_the_template(srv: RunningServer) -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "thinking a"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "ok", "reasoning": "thinking b"},
        {"role": "user", "content": " "},
    ]
    srv.client().chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="auto",
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = srv.engine.rendered[-1]
    assert rendered["tools"] == TOOLS and rendered["kwargs"] == {"enable_thinking": False}
    assert rendered["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "part one\npart two"},
        {"role": "assistant", "content": "", "reasoning_content": "thinking a", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thinking b"},
        {"role": "user", "content": " "},
    ]
    srv.client().chat.completions.create(model="m", messages=messages[-1:], tools=TOOLS, tool_choice="none")
    assert srv.engine.rendered[-1]["tools"] is None
    two = TOOLS + [{"type": "function", "function": {"name": "other"}}]
    srv.client().chat.completions.create(model="m", messages=messages[-1:], tools=two,
                                         tool_choice={"type": "function", "function": {"name": "other"}})
    assert srv.engine.rendered[-1]["tools"] == [two[1]]


def test_tool_calls_streamed_and_not(srv: RunningServer) -> None:
    rng = random.Random()
    args = random_args(rng)
    args["city"] = args["city"].replace("\n", " ") or "x"
    for markup in (hermes("get_weather", args), qwen3_coder("get_weather", args), pythonic([("get_weather", args)])):
        srv.engine.script = Script(pieces=_split_randomly("Checking.\n" + markup, rng))
        client = srv.client()
        request = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
        out = client.chat.completions.create(**request)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
        assert message.tool_calls[0].function.name == "get_weather" and message.tool_calls[0].id.startswith("call_")
        assert json.loads(message.tool_calls[0].function.arguments) == args
        chunks = list(client.chat.completions.create(**request, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(d.content or "" for d in deltas) == "Checking."
        fragments = [tc for d in deltas for tc in d.tool_calls or []]
        assert fragments[0].id.startswith("call_") and fragments[0].function.name == "get_weather"
        assert fragments[0].type == "function" and fragments[0].function.arguments == ""
        assert all(f.index == 0 for f in fragments) and all(f.id is None for f in fragments[1:])
        assert json.loads("".join(f.function.arguments for f in fragments)) == args
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_streamed_and_not(srv: RunningServer) -> None:
    rng = random.Random()
    srv.engine.script = Script(pieces=_split_randomly("<think>\nLet me think.\n</think>\n\nThe answer.", rng))
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    client = srv.client()
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content == "The answer." and message.model_extra["reasoning_content"] == "Let me think."
    chunks = list(client.chat.completions.create(**request, stream=True))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert reasoning == "Let me think."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The answer."
    # the template opened <think> in the prompt: the output starts inside the reasoning
    srv.engine.script = Script(pieces=_split_randomly("Hmm.</think>Yes.", rng))
    message = client.chat.completions.create(
        **request, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert message.content == "Yes." and message.model_extra["reasoning_content"] == "Hmm."


def test_logprobs(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["a", "b", "c"])
    client = srv.client()
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], logprobs=True,
                                         top_logprobs=2)
    emitted = srv.engine.emitted_logprobs[srv.engine.submitted[-1][0]]
    content = out.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [(t.token, t.logprob) for t in emitted]
    assert [[(x.token, x.logprob) for x in t.top_logprobs] for t in content] == \
        [[(x.token, x.logprob) for x in t.top] for t in emitted]
    assert content[0].bytes == list(b"a")
    chunks = list(client.completions.create(model="m", prompt="p", logprobs=1, stream=True))
    emitted = srv.engine.emitted_logprobs[srv.engine.submitted[-1][0]]
    got = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert got == [t.logprob for t in emitted]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == [0, 1, 2]


def test_n_choices_and_echo(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["x", "y"])
    out = srv.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], n=3, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content == "xy" for c in out.choices)
    assert [p.seed for _, _, p in srv.engine.submitted[-3:]] == [5, 6, 7]
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == len(srv.engine.submitted[-1][1].split())
    out = srv.client().completions.create(model="m", prompt=["a b", "c"], n=2, echo=True)
    assert [c.text for c in out.choices] == ["a bxy", "a bxy", "cxy", "cxy"]
    assert out.usage.prompt_tokens == 3


def test_models_and_health(srv: RunningServer) -> None:
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["fake-served", "alias-a"]
    assert all(m.object == "model" and m.owned_by for m in models.data)
    assert srv.client().models.retrieve("alias-a").id == "alias-a"
    health = srv.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
