"""Incremental tool-call parsing of assistant content, for streaming and non-streaming alike.

The format is recognised from the markup itself, so one parser serves every model family:
- Hermes / Qwen:  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (arguments streamed as they arrive)
- Qwen3-Coder:    `<tool_call><function=f><parameter=p>value</parameter></function></tool_call>`
- LFM2 pythonic:  `<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>` (JSON lists also accepted)
Markup split across text deltas is held back until decided and never reaches content. A region that turns out
not to be a tool call (unparseable, or cut off before anything was recognised) is returned as content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from server.api.reasoning import partial_marker_len
from server.api.tool_formats import JsonCallBody, PythonicCallBody, XmlCallBody

# start marker -> end marker
_REGIONS = {"<tool_call>": "</tool_call>", "<|tool_call_start|>": "<|tool_call_end|>"}


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # a fragment of the JSON arguments string


Part = tuple[str, str] | ToolCallStart | ToolCallArgs  # ("content", text) or a tool-call fragment


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """{function: {parameter: JSON-schema type}} for turning XML parameter text into typed values."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        props = (function.get("parameters") or {}).get("properties") or {}
        types = {}
        for name, spec in props.items():
            kind = spec.get("type") if isinstance(spec, dict) else None
            if isinstance(kind, list):
                kind = "string" if "string" in kind else next((k for k in kind if k != "null"), None)
            types[name] = kind
        out[function.get("name", "")] = types
    return out


class _HermesOrXmlBody:
    """After `<tool_call>`: JSON (Hermes/Qwen) when the body opens with `{`, XML when with `<function=`."""

    def __init__(self, param_types: dict[str, dict[str, str]]):
        self._param_types = param_types
        self._pending = ""
        self._inner: JsonCallBody | XmlCallBody | None = None

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self._inner is None:
            self._pending += text
            head = self._pending.lstrip()
            if not head or ("<function=".startswith(head) and len(head) < len("<function=")):
                return []
            self._inner = XmlCallBody(self._param_types) if head.startswith("<function=") else JsonCallBody()
            text, self._pending = self._pending, ""
        return self._inner.feed(text)

    def finish(self, complete: bool) -> list[tuple[str, str]] | None:
        if self._inner is None:
            if not self._pending.strip():
                return []  # `<tool_call></tool_call>`: nothing to say
            self._inner = JsonCallBody()
            self._inner.feed(self._pending)
        return self._inner.finish(complete)


class ToolCallParser:
    """feed(text) / finish() -> list[Part]. Tool-call indices count from 0 over the whole message."""

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self._param_types = parameter_types(tools)
        self._buf = ""
        self._region_end: str | None = None  # set while inside a tool-call region
        self._region_raw = ""
        self._region_calls = 0
        self._body: _HermesOrXmlBody | PythonicCallBody | None = None
        self._num_calls = 0
        self._held_ws = ""  # whitespace next to tool calls is not content
        self._drop_leading_ws = False

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Part]:
        out: list[Part] = []
        if self._region_end is not None:
            self._feed_body(self._buf, out)
            self._buf = ""
            self._close_region(complete=False, out=out)
        elif self._buf:
            self._content(self._buf, out)
        self._buf = ""
        if self._held_ws and self._num_calls == 0:
            out.append(("content", self._held_ws))
        self._held_ws = ""
        return out

    def _step(self, out: list[Part]) -> bool:
        buf = self._buf
        if self._region_end is None:
            found = [(buf.find(m), m) for m in _REGIONS if m in buf]
            if not found:
                keep = partial_marker_len(buf, tuple(_REGIONS))
                self._content(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return False
            start, marker = min(found)
            self._content(buf[:start], out)
            self._open_region(marker)
            self._buf = buf[start + len(marker) :]
            return True
        end = buf.find(self._region_end)
        if end >= 0:
            self._feed_body(buf[:end], out)
            self._buf = buf[end + len(self._region_end) :]
            self._close_region(complete=True, out=out)
            return True
        keep = partial_marker_len(buf, (self._region_end,))
        self._feed_body(buf[: len(buf) - keep], out)
        self._buf = buf[len(buf) - keep :]
        return False

    def _open_region(self, marker: str) -> None:
        self._held_ws = ""  # whitespace before a tool call is layout, not content
        self._region_end = _REGIONS[marker]
        self._region_raw = marker
        self._region_calls = 0
        self._body = _HermesOrXmlBody(self._param_types) if marker == "<tool_call>" else PythonicCallBody()

    def _feed_body(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        self._region_raw += text
        self._emit(self._body.feed(text), out)

    def _close_region(self, complete: bool, out: list[Part]) -> None:
        events = self._body.finish(complete)
        raw = self._region_raw + (self._region_end if complete else "")
        self._region_end, self._body, self._region_raw = None, None, ""
        if events is None and self._region_calls == 0:
            self._content(raw, out)  # not a tool call after all: the model's text, verbatim
            return
        self._emit(events or [], out)
        self._drop_leading_ws = True

    def _emit(self, events: list[tuple[str, str]], out: list[Part]) -> None:
        for kind, value in events:
            if kind == "start":
                out.append(ToolCallStart(self._num_calls, new_call_id(), value))
                self._num_calls += 1
                self._region_calls += 1
            elif value and self._num_calls:
                out.append(ToolCallArgs(self._num_calls - 1, value))

    def _content(self, text: str, out: list[Part]) -> None:
        if self._drop_leading_ws:
            text = text.lstrip()
            if not text:
                return
            self._drop_leading_ws = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            out.append(("content", body))
