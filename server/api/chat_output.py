"""Generated text -> OpenAI chat shapes: reasoning/content/tool-call parts, stream deltas, the final message,
and logprobs. Streaming and non-streaming run the same parsers, so both give the same answer.
"""

from __future__ import annotations

import math
from typing import Any

from server.api.reasoning import ReasoningParser
from server.api.tool_parsers import Part, ToolCallArgs, ToolCallParser, ToolCallStart
from server.engine.types import TokenLogprob


class ChatOutputParser:
    """Text deltas of one choice -> ordered parts: ("reasoning", t), ("content", t), tool-call fragments."""

    def __init__(self, *, start_in_reasoning: bool, tools: list[dict[str, Any]] | None):
        self._reasoning = ReasoningParser(start_in_reasoning)
        self._tools = ToolCallParser(tools) if tools else None

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str) -> list[Part]:
        return self._route(self._reasoning.feed(text)) if text else []

    def finish(self) -> list[Part]:
        out = self._route(self._reasoning.finish())
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _route(self, pieces: list[tuple[str, str]]) -> list[Part]:
        out: list[Part] = []
        for kind, text in pieces:
            if kind == "content" and self._tools is not None:
                out.extend(self._tools.feed(text))
            else:
                out.append((kind, text))
        return out


def delta_dicts(parts: list[Part], reasoning_field: str) -> list[dict[str, Any]]:
    """Stream deltas for `parts`: consecutive text of one kind merged, a tool call's header on its own,
    consecutive argument fragments of one call merged."""
    deltas: list[dict[str, Any]] = []
    for part in parts:
        last = deltas[-1] if deltas else None
        if isinstance(part, ToolCallStart):
            function = {"name": part.name, "arguments": ""}
            deltas.append({"tool_calls": [{"index": part.index, "id": part.id, "type": "function", "function": function}]})
        elif isinstance(part, ToolCallArgs):
            calls = last.get("tool_calls") if last else None
            if calls and "id" not in calls[0] and calls[0]["index"] == part.index:
                calls[0]["function"]["arguments"] += part.text
            else:
                deltas.append({"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]})
        else:
            kind, text = part
            key = reasoning_field if kind == "reasoning" else "content"
            if last is not None and list(last) == [key]:
                last[key] += text
            else:
                deltas.append({key: text})
    return deltas


class MessageBuilder:
    """Accumulates parts into the non-streaming `message` object."""

    def __init__(self, reasoning_field: str):
        self._reasoning_field = reasoning_field
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, parts: list[Part]) -> None:
        for part in parts:
            if isinstance(part, ToolCallStart):
                function = {"name": part.name, "arguments": ""}
                self._calls[part.index] = {"id": part.id, "type": "function", "function": function}
            elif isinstance(part, ToolCallArgs):
                self._calls[part.index]["function"]["arguments"] += part.text
            elif part[0] == "reasoning":
                self._reasoning.append(part[1])
            else:
                self._content.append(part[1])

    def message(self) -> dict[str, Any]:
        content = "".join(self._content)
        # content stays present, null when the answer is only tool calls (clients read the key)
        message: dict[str, Any] = {"role": "assistant", "content": None if self._calls and not content else content}
        if self._reasoning:
            message[self._reasoning_field] = "".join(self._reasoning)
        if self._calls:
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return message


def _finite(logprob: float) -> float:
    # -inf (a masked token) is not valid JSON; OpenAI reports such tokens as -9999.0
    return logprob if math.isfinite(logprob) else -9999.0


_BYTES_PREFIX = "bytes:"  # OpenAI/vLLM spelling of a token that is not whole UTF-8: "bytes:\\xe2\\x80"


def _token_bytes(token: str) -> list[int]:
    if token.startswith(_BYTES_PREFIX):
        try:
            return list(bytes.fromhex(token[len(_BYTES_PREFIX) :].replace("\\x", "")))
        except ValueError:
            pass
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _finite(t.logprob),
                "bytes": _token_bytes(t.token),
                "top_logprobs": [
                    {"token": top.token, "logprob": _finite(top.logprob), "bytes": _token_bytes(top.token)} for top in t.top
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """Legacy completions shape; `text_offset` is where the first token's text starts in the choice's text."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{top.token: _finite(top.logprob) for top in t.top} or {t.token: _finite(t.logprob)} for t in tokens],
        "text_offset": offsets,
    }
