"""Pydantic models of the Anthropic Messages requests this server accepts, and their mapping to the chat-template
messages, tools and SamplingParams that chat completions use.

Unknown fields are ignored (clients send `metadata`, `service_tier`, `container`, ...). Blocks other than text,
tool_use, tool_result and thinking are a 400: this server serves text-only models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import APIError
from server.api.schemas import MAX_TOOLS, Number, StrictInt, check_parameters, check_tool_name, stop_strings
from server.api.structured import turn_constraint
from server.engine.types import SamplingParams, StructuredOutput

MIN_THINKING_BUDGET = 1024  # the Messages API's minimum


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (bash_*, web_search_*, ...) have other types: a 400


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class CountTokensRequest(_Lenient):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _joined(self.system)})
        for message in self.messages:
            out.extend(_template_messages(message))
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` mapped to the templates' switch (Qwen3's enable_thinking); absent means no thinking, as in
        the Messages API (whatever the template's default)."""
        return {"enable_thinking": self.thinking is not None and self.thinking.type != "disabled"}

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """OpenAI-style function tools the template sees: none for tool_choice none, the named one for "tool"."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice.type in ("any", "tool"):
                raise APIError(400, "tool_choice requires a non-empty tools list.", param="tool_choice")
            return None
        for i, tool in enumerate(self.tools):
            check_tool_name(tool.name, f"tools.{i}.name")
            check_parameters(tool.input_schema, f"tools[{i}].input_schema")
        if choice is not None and choice.type == "none":
            return None
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in self.tools
        ]
        if choice is not None and choice.type == "tool":
            named = [t for t in tools if t["function"]["name"] == choice.name]
            if not named:
                names = ", ".join(t.name for t in self.tools)
                raise APIError(400, f"tool_choice names tool {choice.name!r}, which is not in tools ({names}).",
                               param="tool_choice.name")
            return named
        return tools


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: Number | None = Field(None, ge=0, le=1)
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: bool = False

    def check_thinking(self) -> None:
        """Anthropic's rules: budget_tokens at least 1,024 and under max_tokens; no thinking while tool_choice
        forces a tool."""
        thinking = self.thinking
        if thinking is None or thinking.type == "disabled":
            return
        budget = thinking.budget_tokens
        if thinking.type == "enabled" and budget is None:
            raise APIError(400, "thinking.budget_tokens: Field required", param="thinking.budget_tokens")
        if budget is not None and not MIN_THINKING_BUDGET <= budget < self.max_tokens:
            raise APIError(400, f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
                           f"max_tokens ({self.max_tokens}), got {budget}.", param="thinking.budget_tokens")
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise APIError(400, "Thinking may not be enabled when tool_choice forces tool use.", param="tool_choice")

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            stop=stop_strings(self.stop_sequences),
            reasoning_budget=self._thinking_budget(),
        )

    def _thinking_budget(self) -> int | None:
        """The engine ends the reasoning by budget_tokens (when thinking is on and sets one)."""
        thinking = self.thinking
        return None if thinking is None or thinking.type == "disabled" else thinking.budget_tokens

    def constraint(self, prompt: str, tools: list[dict[str, Any]] | None) -> StructuredOutput | None:
        """tool_choice "any" / "tool" -> a call in the model's own format (one only for "tool" or with
        disable_parallel_tool_use); "auto" stays free text, so its disable_parallel_tool_use is not enforced."""
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        return turn_constraint(prompt, tools, force_tool=True,
                               parallel=choice.type == "any" and not choice.disable_parallel_tool_use)


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _template_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic turn -> template messages: a user turn's tool_result blocks become `tool` messages (in block
    order, around its text); an assistant turn becomes one message with reasoning, content and tool calls."""
    blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
    if message.role == "assistant":
        return [_assistant_message(blocks)]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _joined(block.content)})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        # thinking and tool_use in a user turn carry nothing a template renders there
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    reasoning = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks if isinstance(b, ToolUseBlock)
    ]
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out
