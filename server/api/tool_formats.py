"""The bodies of tool-call regions, one incremental parser per format (used by tool_parsers.ToolCallParser).

Each body gets the text between the start and end markers in arbitrary pieces; feed() returns events
("start", name) / ("args", JSON fragment); finish(complete) returns the last events, or None when nothing in
the region could be read as a tool call (the caller then gives the region back as content).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

Events = list[tuple[str, str]]

_HEADER_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MAX_HEADER_CHARS = 4096  # past this, stop looking for a name-first header and parse at the end


def parse_json_calls(text: str) -> list[tuple[str, str]] | None:
    """Complete JSON call objects (one, several, or a list) -> [(name, arguments JSON)], None if not calls."""
    decoder = json.JSONDecoder()
    objects: list[Any] = []
    text = text.strip()
    pos = 0
    try:
        while pos < len(text):
            obj, pos = decoder.raw_decode(text, pos)
            objects.extend(obj if isinstance(obj, list) else [obj])
            pos = len(text) - len(text[pos:].lstrip(" \t\r\n,"))
    except json.JSONDecodeError:
        return None
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls or None


def _call_events(calls: list[tuple[str, str]] | None) -> Events | None:
    if calls is None:
        return None
    return [event for name, args in calls for event in (("start", name), ("args", args))]


class _JsonValueScanner:
    """Finds where one JSON object/array ends, char by char, across pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """Number of leading chars of `text` that belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class JsonCallBody:
    """`{"name": "f", "arguments": {...}}`: once the name is known, the arguments object streams raw."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "header"  # header -> args -> after_args; or buffered (parse everything at the end)
        self._scanner = _JsonValueScanner()

    def feed(self, text: str) -> Events:
        if self._state == "args":
            return self._scan(text)
        if self._state != "header":
            self._buf += text
            return []
        self._buf += text
        match = _HEADER_RE.match(self._buf)
        if match is None or match.end() == len(self._buf):
            if match is None and len(self._buf) > _MAX_HEADER_CHARS:
                self._state = "buffered"
            return []
        if self._buf[match.end()] != "{":
            self._state = "buffered"  # string or odd arguments: decide on the complete text
            return []
        name = json.loads(f'"{match.group(1)}"')
        self._state = "args"
        return [("start", name), *self._scan(self._buf[match.end() :])]

    def _scan(self, text: str) -> Events:
        used = self._scanner.feed(text)
        if self._scanner.done:
            self._state = "after_args"
        return [("args", text[:used])] if used else []

    def finish(self, complete: bool) -> Events | None:
        if self._state in ("args", "after_args"):
            return []
        return _call_events(parse_json_calls(self._buf))


class XmlCallBody:
    """Qwen3-Coder: `<function=f><parameter=p>value</parameter>...</function>`, one argument per parameter."""

    def __init__(self, param_types: dict[str, dict[str, str]]):
        self._param_types = param_types
        self._buf = ""
        self._state = "seek_function"  # -> in_function -> in_param -> in_function -> seek_function
        self._function = ""
        self._param = ""
        self._num_params = 0
        self._num_functions = 0

    def feed(self, text: str) -> Events:
        self._buf += text
        events: Events = []
        while self._step(events):
            pass
        return events

    def finish(self, complete: bool) -> Events | None:
        events: Events = []
        if self._state == "in_param":
            events.append(self._param_event(self._buf))
            self._state = "in_function"
        if self._state == "in_function":
            events.append(("args", "}" if self._num_params else "{}"))  # cut short: keep the JSON whole
        if self._num_functions == 0:
            return None
        return events

    def _step(self, events: Events) -> bool:
        buf = self._buf
        if self._state == "seek_function":
            start = buf.find("<function=")
            close = buf.find(">", start) if start >= 0 else -1
            if close < 0:
                return False
            self._function = buf[start + len("<function=") : close].strip()
            self._num_functions += 1
            self._num_params = 0
            self._state, self._buf = "in_function", buf[close + 1 :]
            events.append(("start", self._function))
            return True
        if self._state == "in_function":
            param, end = buf.find("<parameter="), buf.find("</function>")
            if end >= 0 and (param < 0 or end < param):
                events.append(("args", "}" if self._num_params else "{}"))
                self._state, self._buf = "seek_function", buf[end + len("</function>") :]
                return True
            close = buf.find(">", param) if param >= 0 else -1
            if close < 0:
                return False
            self._param = buf[param + len("<parameter=") : close].strip()
            self._state, self._buf = "in_param", buf[close + 1 :]
            return True
        end, skip = buf.find("</parameter>"), len("</parameter>")
        if end < 0:  # a model that forgets </parameter>: the next tag ends the value
            ends = [i for i in (buf.find("<parameter="), buf.find("</function>")) if i >= 0]
            if not ends:
                return False
            end, skip = min(ends), 0
        events.append(self._param_event(buf[:end]))
        self._state, self._buf = "in_function", buf[end + skip :]
        return True

    def _param_event(self, raw: str) -> tuple[str, str]:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        kind = self._param_types.get(self._function, {}).get(self._param)
        prefix = "{" if self._num_params == 0 else ", "
        self._num_params += 1
        typed = json.dumps(_typed_value(value, kind), ensure_ascii=False)
        return ("args", f"{prefix}{json.dumps(self._param, ensure_ascii=False)}: {typed}")


def _typed_value(value: str, kind: str | None) -> Any:
    """Parameter text as the schema's type; text stays a string when the type is unknown or it doesn't parse."""
    if kind in (None, "string"):
        return value
    text = value.strip()
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(text)  # Python-style dicts/lists: {'a': 1}
        except (ValueError, SyntaxError):
            return value


class PythonicCallBody:
    """LFM2: `[f(a=1, b="x"), g()]`; each call is emitted when its closing parenthesis arrives."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._base_depth: int | None = None
        self._depth = 0
        self._quote = ""
        self._escape = False
        self._call_start: int | None = None
        self._json = False
        self._num_calls = 0

    def feed(self, text: str) -> Events:
        self._buf += text
        if self._base_depth is None and not self._decide_layout():
            return []
        if self._json:
            return []
        return self._scan()

    def finish(self, complete: bool) -> Events | None:
        if self._json:
            return _call_events(parse_json_calls(self._buf))
        return [] if self._num_calls else None

    def _decide_layout(self) -> bool:
        head = self._buf.lstrip()
        inner = head[1:].lstrip() if head.startswith("[") else head
        if not inner:
            return False
        self._json = inner.startswith("{")
        self._base_depth = 1 if head.startswith("[") else 0
        return True

    def _scan(self) -> Events:
        events: Events = []
        buf = self._buf
        for pos in range(self._pos, len(buf)):
            ch = buf[pos]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "\"'":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if ch == ")" and self._depth == self._base_depth and self._call_start is not None:
                    events.extend(self._call(buf[self._call_start : pos + 1]))
                    self._call_start = None
            elif self._depth == self._base_depth and self._call_start is None and (ch.isalpha() or ch == "_"):
                self._call_start = pos
        self._pos = len(buf)
        return events

    def _call(self, text: str) -> Events:
        try:
            node = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return []
        if not isinstance(node, ast.Call):
            return []
        args: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                continue
            try:
                args[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:
                args[keyword.arg] = ast.unparse(keyword.value)  # a name or expression: keep its source
        self._num_calls += 1
        return [("start", ast.unparse(node.func)), ("args", json.dumps(args, ensure_ascii=False, default=str))]
