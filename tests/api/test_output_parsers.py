"""Tool-call and reasoning parsers, fed the same text split at every possible point (and char by char).

The reference is the call we generated the markup from (fresh random names and arguments each run) and the
plain text around it; whatever the split, the parsed calls must equal it and no markup may reach content.
"""

from __future__ import annotations

import json
import random

import pytest

from server.api.chat_output import ChatOutputParser, MessageBuilder, delta_dicts
from server.api.reasoning import ReasoningParser
from server.api.tool_parsers import ToolCallArgs, ToolCallParser, ToolCallStart
from tests.api.tool_markup import TOOLS, hermes, pythonic, qwen3_coder, random_args, random_chars

MARKUP = ("<tool_call", "</tool_call", "<function", "</function", "<parameter", "<|tool_call", "<think", "</think")


def run_tool_parser(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, dict]], list]:
    parser = ToolCallParser(tools)
    parts = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
    content = "".join(p[1] for p in parts if isinstance(p, tuple))
    calls: dict[int, list] = {}
    for p in parts:
        if isinstance(p, ToolCallStart):
            assert p.index == len(calls) and p.id.startswith("call_")
            calls[p.index] = [p.name, ""]
        elif isinstance(p, ToolCallArgs):
            calls[p.index][1] += p.text
    return content, [(name, json.loads(args)) for name, args in calls.values()], parts


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """Every 2-way split, char by char, and a few random 3-way splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    for _ in range(20):
        i, j = sorted(rng.sample(range(len(text) + 1), 2))
        out.append([text[:i], text[i:j], text[j:]])
    return out


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "pythonic"])
def test_tool_call_at_every_split_point(fmt: str) -> None:
    rng = random.Random()
    args = random_args(rng)
    if fmt == "qwen3_coder":
        args["city"] = args["city"].replace("\n", " ") or "x"  # XML values are raw text between newlines
    markup = {"hermes": hermes("get_weather", args), "qwen3_coder": qwen3_coder("get_weather", args),
              "pythonic": pythonic([("get_weather", args)])}[fmt]
    text = "Let me check.\n\n" + markup + "\n"
    for pieces in splits(text, rng):
        content, calls, _ = run_tool_parser(pieces)
        assert content == "Let me check."
        assert calls == [("get_weather", args)]


def test_several_calls_and_text_after() -> None:
    rng = random.Random()
    a1, a2 = random_args(rng), random_args(rng)
    text = hermes("get_weather", a1) + "\n" + hermes("get_time", a2) + "\n\nDone."
    for pieces in splits(text, rng)[::3]:
        content, calls, _ = run_tool_parser(pieces)
        assert calls == [("get_weather", a1), ("get_time", a2)]
        assert content == "Done."
    content, calls, _ = run_tool_parser([pythonic([("f", a1), ("g", {}), ("h", a2)])])
    assert calls == [("f", a1), ("g", {}), ("h", a2)] and content == ""


def test_hermes_arguments_stream_before_the_call_ends() -> None:
    args = random_args(random.Random())
    text = hermes("get_weather", args)
    parser = ToolCallParser(TOOLS)
    cut = text.index('"nested"')  # mid-arguments
    parts = parser.feed(text[:cut])
    assert isinstance(parts[0], ToolCallStart) and parts[0].name == "get_weather"
    streamed = "".join(p.text for p in parts if isinstance(p, ToolCallArgs))
    assert streamed and json.dumps(args, ensure_ascii=False).startswith(streamed)


def test_arguments_first_and_string_arguments_are_parsed_at_the_end() -> None:
    args = random_args(random.Random())
    odd = '<tool_call>{"arguments": ' + json.dumps(args) + ', "name": "f"}</tool_call>'
    as_string = '<tool_call>{"name": "g", "arguments": ' + json.dumps(json.dumps(args)) + "}</tool_call>"
    for text in (odd, as_string):
        for i in range(len(text) + 1):
            content, calls, _ = run_tool_parser([text[:i], text[i:]])
            assert content == "" and calls == [("f" if text is odd else "g", args)]


@pytest.mark.parametrize("text", [
    "Use <tool_cal> or <|tool_ and a < b > c, then <tool",  # near-misses stay content, verbatim
    "  leading and trailing whitespace\n\n",
    "<tool_call>this is not json</tool_call> said the model",
    '<tool_call>{"name": "f", "argu',  # cut off before anything was recognised: given back as text
])
def test_text_that_is_not_a_call_is_content_verbatim(text: str) -> None:
    for pieces in splits(text, random.Random()):
        content, calls, _ = run_tool_parser(pieces)
        assert calls == [] and content == text


def test_call_cut_off_mid_arguments_keeps_its_streamed_prefix() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2'
    for i in range(len(text) + 1):
        parser = ToolCallParser(TOOLS)
        parts = parser.feed(text[:i]) + parser.feed(text[i:]) + parser.finish()
        assert parts[0] == ToolCallStart(0, parts[0].id, "f")
        assert "".join(p.text for p in parts[1:]) == '{"a": [1, 2'


def test_truncated_xml_call_still_gives_valid_json() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    parser = ToolCallParser(TOOLS)
    parts = parser.feed(text) + parser.finish()
    args = "".join(p.text for p in parts if isinstance(p, ToolCallArgs))
    assert json.loads(args) == {"city": "Paris", "days": 3}


def run_reasoning(pieces: list[str], start_in_reasoning: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(start_in_reasoning)
    out = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
    return "".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content")


def test_reasoning_at_every_split_point() -> None:
    rng = random.Random()
    thought = random_chars(rng, 30) + "\nsecond line <b> not a tag"
    answer = "The answer" + random_chars(rng, 20)
    for start_in_reasoning, text in ((False, f"<think>\n{thought}\n</think>\n\n{answer}"),
                                     (True, f"\n{thought}\n</think>\n\n{answer}")):
        for pieces in splits(text, rng):
            assert run_reasoning(pieces, start_in_reasoning) == (thought.strip(), answer)


def test_output_without_think_is_untouched_and_truncated_thinking_is_reasoning() -> None:
    rng = random.Random()
    for text in ("  <thin", "<b>bold</b> " + random_chars(rng, 10), "\n\nplain</think>"):
        for pieces in splits(text, rng):
            assert run_reasoning(pieces) == ("", text)
    assert run_reasoning(["<th", "ink>still thinking"]) == ("still thinking", "")


def test_reasoning_then_tool_call_through_chat_parser() -> None:
    rng = random.Random()
    args = random_args(rng)
    text = "<think>I should call a tool: <tool_call> is how.</think>\n\n" + hermes("get_weather", args)
    for pieces in splits(text, rng)[::2]:
        parser = ChatOutputParser(start_in_reasoning=False, tools=TOOLS)
        builder = MessageBuilder("reasoning_content")
        for piece in pieces:
            builder.add(parser.feed(piece))
        builder.add(parser.finish())
        message = builder.message()
        assert message["content"] is None and parser.has_tool_calls
        assert message["reasoning_content"] == "I should call a tool: <tool_call> is how."
        call = message["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == args


def test_delta_dicts_shapes() -> None:
    parts = [("reasoning", "a"), ("reasoning", "b"), ("content", "c"), ToolCallStart(0, "call_x", "f"),
             ToolCallArgs(0, '{"a"'), ToolCallArgs(0, ": 1}"), ToolCallStart(1, "call_y", "g"), ToolCallArgs(1, "{}")]
    assert delta_dicts(parts, "reasoning") == [
        {"reasoning": "ab"},
        {"content": "c"},
        {"tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_y", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    for part in parts:
        if isinstance(part, tuple):
            assert not any(m in part[1] for m in MARKUP)


def test_logprob_bytes_of_partial_utf8_tokens() -> None:
    from server.api.chat_output import chat_logprobs
    from server.engine.types import TokenLogprob, TopLogprob

    raw = bytes(random.Random().randrange(128, 256) for _ in range(3))
    shown = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    rendered = chat_logprobs([TokenLogprob(5, shown, float("-inf"), [TopLogprob(6, "é", -0.25)])])["content"][0]
    assert rendered["token"] == shown and rendered["bytes"] == list(raw) and rendered["logprob"] == -9999.0
    assert rendered["top_logprobs"] == [{"token": "é", "logprob": -0.25, "bytes": list("é".encode())}]
