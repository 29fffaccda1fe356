"""Pydantic models of the OpenAI Responses requests this server accepts (stateless), and their mapping to the
chat-template messages, tools and SamplingParams that chat completions use.

Input items: messages (role user / assistant / system / developer; text parts), function_call,
function_call_output and reasoning (rendered as the next assistant turn's reasoning). Tools of types other than
"function" (web_search, file_search, custom, ...) are dropped: no model here can call them, and agents send fixed
tool lists. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from server.api.errors import APIError, validation_error, with_param_names
from server.api.messages import template_tool_call, text_content
from server.api.schemas import (
    MAX_TOOLS,
    FunctionCall,
    JsonSchemaFormat,
    Number,
    ResponseFormat,
    StrictInt,
    ToolCall,
    check_parameters,
    check_tool_name,
)
from server.api.structured import turn_constraint
from server.engine.types import SamplingParams, StructuredOutput


# reasoning items come back with their text in plain `content`, which is what a client sends back in the next turn
INCLUDABLE = frozenset({"reasoning.encrypted_content"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningText(_Lenient):
    text: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Lenient):
    """text.format: the Responses API spells json_schema's name, schema and strict flat, beside the type."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> ResponseFormat:
        spec = None
        if self.schema_ is not None:
            spec = JsonSchemaFormat(name=self.name, description=self.description, schema=self.schema_,
                                    strict=self.strict)
        return ResponseFormat(type=self.type, json_schema=spec)


class TextConfig(_Lenient):
    format: TextFormat | None = None


class Reasoning(_Lenient):
    effort: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: list[InputItem]  # a string is one user message
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None  # checked by tools_for_template, to name it in one error
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    stream: bool = False
    store: bool | None = None  # accepted either way: nothing is stored, and the response says `store: false`
    background: bool | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    def check_stateless(self) -> None:
        """What needs a stored response is refused, naming the field; so are `include` values it cannot give."""
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id is not supported: this server keeps no responses. Send the "
                           "whole conversation in `input` (store=false semantics).", param="previous_response_id")
        if self.background:
            raise APIError(400, "background is not supported: this server keeps no responses to retrieve later. Send "
                           "the request without it (stream it to see a long answer as it comes).", param="background")
        for value in self.include or []:
            if value not in INCLUDABLE:
                raise APIError(400, f"include value {value!r} is not supported; the accepted one is "
                               "\"reasoning.encrypted_content\" (reasoning items carry their text unencrypted).",
                               param="include")

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_output_tokens is None else self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
        )

    def constraint(self, prompt: str, tools: list[dict[str, Any]] | None) -> StructuredOutput | None:
        """text.format, or the tool call tool_choice "required" or a named function asks for (one call when
        named or parallel_tool_calls is false)."""
        named = self._named_function() is not None
        response_format = self.text.format.as_response_format() if self.text and self.text.format else None
        return turn_constraint(prompt, tools, force_tool=named or self.tool_choice == "required",
                               parallel=not named and self.parallel_tool_calls is not False,
                               response_format=response_format, format_param="text.format")

    def template_kwargs(self) -> dict[str, Any]:
        """reasoning.effort "none" turns the template's thinking switch off; other efforts keep its default."""
        return {"enable_thinking": False} if self.reasoning is not None and self.reasoning.effort == "none" else {}

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                continue
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as exc:
                raise with_param_names(validation_error(exc, prefix=f"tools[{i}]."), {}) from None
            check_tool_name(tools[-1].name, f"tools[{i}].name")
            check_parameters(tools[-1].parameters, f"tools[{i}].parameters")
        return tools

    def _named_function(self) -> str | None:
        """The function a tool_choice object names; None for "auto" / "none" / "required"; 400 otherwise."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none", "required"):
            return None
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return choice["name"]
        raise APIError(400, f"tool_choice must be \"auto\", \"none\", \"required\" or "
                       f"{{\"type\": \"function\", \"name\": ...}}, got {choice!r}.", param="tool_choice")

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        named = self._named_function()
        tools = self.function_tools()
        if not tools:
            if named is not None or self.tool_choice == "required":
                raise APIError(400, "tool_choice requires a non-empty list of function tools.", param="tool_choice")
            return None
        if self.tool_choice == "none":
            return None
        as_chat = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in tools]
        if named is None:
            return as_chat
        chosen = [t for t in as_chat if t["function"]["name"] == named]
        if not chosen:
            names = ", ".join(t.name for t in tools)
            raise APIError(400, f"tool_choice names function {named!r}, which is not in tools ({names}).",
                           param="tool_choice")
        return chosen

    def template_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        reasoning: list[str] = []  # reasoning items wait for the assistant turn they belong to
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if isinstance(item, ReasoningItem):
                reasoning += [part.text for part in item.content or item.summary]
                continue
            if isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": text_content(item.output, f"{where}.output")})
            elif isinstance(item, FunctionCallItem):
                call = template_tool_call(ToolCall(id=item.call_id, function=FunctionCall(
                    name=item.name, arguments=item.arguments)), where)
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": text_content(item.content, f"{where}.content")})
            if reasoning and out and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
        return out
