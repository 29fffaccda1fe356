"""Tool-call markup of the chat templates' formats (Hermes JSON, Qwen3-Coder XML, LFM2 pythonic), built from a
call, and random arguments of every JSON type, for the parser and HTTP tests."""

from __future__ import annotations

import json
import random
import string
from typing import Any


def random_chars(rng: random.Random, n: int, alphabet: str = string.ascii_letters + " ,.éß😀\"'{}[]\\") -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_args(rng: random.Random) -> dict[str, Any]:
    return {
        "city": random_chars(rng, rng.randint(1, 12)),
        "days": rng.randint(-5, 500),
        "ratio": round(rng.uniform(-10, 10), 3),
        "metric": rng.random() < 0.5,
        "tags": [random_chars(rng, 3) for _ in range(rng.randint(0, 3))],
        "nested": {"a": rng.randint(0, 9), "b": None, "c": {"d": random_chars(rng, 4)}},
    }


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "tags": {"type": "array"}, "nested": {"type": "object"}}}}}]


def hermes(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def qwen3_coder(name: str, args: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def pythonic(calls: list[tuple[str, dict]]) -> str:
    body = ", ".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})" for name, args in calls)
    return f"<|tool_call_start|>[{body}]<|tool_call_end|>"
