"""OpenAI chat messages -> the plain dicts a Hugging Face chat template expects.

- `developer` becomes `system`, legacy `function` becomes `tool`;
- content-part lists are joined into one string (text-only server: other parts are a 400);
- `tool_calls[].function.arguments` JSON strings become dicts (templates index into them, as mlx-lm does);
- `reasoning_content` / `reasoning` history is passed on as `reasoning_content`.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.errors import APIError
from server.api.json_checks import check_json_body
from server.api.schemas import ChatMessage, ToolCall

_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [_template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _template_message(message: ChatMessage, where: str) -> dict[str, Any]:
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    out: dict[str, Any] = {"role": role, "content": text_content(message.content, f"{where}.content")}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [template_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def text_content(content: str | list[Any] | None, where: str) -> str:
    if content is None:
        return ""  # assistant turns with only tool calls; templates expect a string
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if part_type in ("image_url", "input_image", "image"):
            raise APIError(
                400,
                f"{where}[{k}] is an image, and images are not supported: this server serves text-only "
                "models. Send text content only.",
                param=f"{where}[{k}]",
                code="unsupported_content",
            )
        raise APIError(
            400,
            f"{where}[{k}] has content part type {part_type!r}; only text parts are supported.",
            param=f"{where}[{k}]",
            code="unsupported_content",
        )
    return "\n".join(texts)


def template_tool_call(call: ToolCall, where: str) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:  # malformed, a number past int's digit limit, or deep nesting
            raise APIError(
                400, f"{where}.function.arguments is not valid JSON: {exc}", param=f"{where}.function.arguments",
            ) from None
        check_json_body(arguments, f"{where}.function.arguments")  # the body's own walk saw only a string
    out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out
