"""Pydantic models of the OpenAI requests this server accepts, and their mapping to SamplingParams.

Unknown fields are ignored (editors send `prompt_cache_key`, ...). `reasoning_effort: "none"` turns the template's
thinking switch off (enable_thinking=False), as Responses' reasoning.effort does; chat_template_kwargs win.
Extras beyond OpenAI's fields follow vLLM's names: top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, include_stop_str_in_output, chat_template_kwargs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import APIError
from server.engine.types import InfillPrompt, SamplingParams

MAX_CHOICES = 64  # n x prompts per request; each choice is one engine request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # what Zed sends back in history
    reasoning: str | None = None  # vLLM / Ollama spelling


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Lenient):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Lenient):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # extras (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_logit_bias(self.logit_bias),
            stop=stop_strings(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # Zed sends only this one
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    reasoning_effort: str | None = None  # "none" turns the template's thinking off; other efforts keep its default

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.requested_max_tokens
        return self._sampling_params(default_max_tokens if max_tokens is None else max_tokens, logprobs)

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """The tools the template sees: none for tool_choice "none", only the named one for a named choice."""
        choice = self.tool_choice
        if not self.tools:
            if isinstance(choice, NamedToolChoice) or choice == "required":
                raise APIError(400, "tool_choice requires a non-empty tools list.", param="tool_choice")
            return None
        for i, tool in enumerate(self.tools):
            check_tool_name(tool.function.name, f"tools[{i}].function.name")
            check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
        if choice == "none":
            return None
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not named:
                names = ", ".join(t["function"]["name"] for t in tools)
                raise APIError(
                    400,
                    f"tool_choice names function {choice.function.name!r}, which is not in tools ({names}).",
                    param="tool_choice",
                )
            return named
        return tools


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    t_max_predict_ms: float | None = None  # llama.cpp's name: the generation's time budget, 0 or none for none

    def prompts(self) -> list[str | list[int] | InfillPrompt]:
        """The prompts to complete; with a non-empty suffix, fill-in-the-middle prompts (text only)."""
        prompts = self._plain_prompts()
        if not self.suffix:
            return prompts
        if self.echo:
            raise APIError(400, "echo is not supported with suffix (fill-in-the-middle): the answer is the middle "
                                "only; the client already holds the prompt and the suffix.", param="echo")
        if not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "suffix (fill-in-the-middle) needs text prompts, not token ids.", param="prompt")
        return [InfillPrompt(prefix=p, suffix=self.suffix) for p in prompts]  # type: ignore[arg-type]

    def _plain_prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if len(prompt) * self.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompt)} prompts x n={self.n} exceeds {MAX_CHOICES} choices per request.",
                           param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of other than n is not supported.", param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs).", param="echo")
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        params = self._sampling_params(max_tokens, self.logprobs)
        params.max_predict_ms = time_budget(self.t_max_predict_ms)
        return params


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # as OpenAI and Anthropic accept them


def check_tool_name(name: str, where: str, message_prefix: str = "") -> None:
    """A tool name as OpenAI and Anthropic accept it: one that could spell markup (`</tool_call>`) or break a
    call's syntax is refused. `message_prefix`: how the message names the field (Anthropic's dotted paths)."""
    if not TOOL_NAME.fullmatch(name):
        raise APIError(400, f"{message_prefix}{where} must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name[:80]!r}.",
                       param=where, code="invalid_tool_name")


def check_parameters(parameters: dict[str, Any] | None, where: str) -> None:
    """The JSON-schema shape the tool-call parsers read: `properties` maps names to schemas."""
    properties = (parameters or {}).get("properties")
    if properties is not None and not isinstance(properties, dict):
        raise APIError(400, f"{where}.properties must be an object mapping parameter names to JSON schemas.",
                       param=where)


def time_budget(t_max_predict_ms: float | None) -> float | None:
    """llama.cpp's t_max_predict_ms as SamplingParams.max_predict_ms: 0 (its default) and none mean no budget."""
    if t_max_predict_ms is not None and t_max_predict_ms < 0:
        raise APIError(400, f"t_max_predict_ms must be >= 0 (0: no time budget), got {t_max_predict_ms}.",
                       param="t_max_predict_ms")
    return t_max_predict_ms or None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """Any number of stop strings; empty ones are dropped (LibreChat sends `stop: [""]`)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    return [s for s in items if s]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
    return out
