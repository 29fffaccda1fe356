"""Pydantic models of the Ollama API requests this server accepts (ollama/ollama docs/api.md), and their mapping
to the OpenAI-side request objects the chat and completion paths already serve.

`options`: temperature, top_p, top_k, min_p, seed, num_predict (-1 and -2: up to the context), stop,
repeat_penalty (-> repetition_penalty), presence_penalty, frequency_penalty. num_ctx is accepted and capped at
the server's context (`--max-model-len`, fixed at start): a larger one does not grow it, a smaller one does not
shrink it. repeat_last_n is accepted, but no window applies (repeat_penalty sees prompt and output, the presence
and frequency penalties the output).
mirostat, typical_p and tfs_z other than their "off" values are refused: the sampler has no such stage. The
runner's own options (num_gpu, num_thread, num_batch, use_mmap, ...) and unknown keys are ignored.
`ignore_eos` is mps-serve's extension, as on /v1.
Left out, a sampling option takes the server's default (as on /v1: temperature 1, no top-k, top-p or penalty),
not Ollama's runner defaults.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import APIError
from server.api.schemas import ChatMessage, FunctionCall, JsonSchemaFormat, ResponseFormat, Tool, ToolCall

ThinkLevel = Literal["low", "medium", "high", "max"]
# options whose "off" value is the only one the sampler can honour
_OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(_Lenient):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    num_ctx: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None
    mirostat: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    ignore_eos: bool | None = None  # mps-serve's extension, as on /v1 (benchmarks count a fixed number of tokens)

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI-side request fields (vLLM's extras included) these options set; refuses what the sampler
        cannot do."""
        for name, off in _OFF_VALUES.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise APIError(400, f"options.{name}={value} is not supported: the sampler has no {name} stage "
                               f"(leave it out or set {off}).", param=f"options.{name}")
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "seed": self.seed, "stop": self.stop, "repetition_penalty": self.repeat_penalty,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "ignore_eos": self.ignore_eos}
        return {k: v for k, v in fields.items() if v is not None}

    def max_tokens(self, max_model_len: int) -> int:
        """num_predict as a token budget: left out, -1 (no limit) and -2 (fill the context) run up to the
        context; the engine stops a request at the end of the context either way."""
        value = self.num_predict
        if value is None or value in (-1, -2):
            return max_model_len
        if value < 1:
            raise APIError(400, f"options.num_predict must be at least 1, or -1 (no limit), got {value}.",
                           param="options.num_predict")
        return value


class OllamaFunctionCall(_Lenient):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(_Lenient):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    def chat_message(self, where: str) -> ChatMessage:
        refuse_images(self.images, f"{where}.images")
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
                 for c in self.tool_calls or []]
        return ChatMessage(role=self.role, content=self.content or "", reasoning=self.thinking,
                           tool_calls=calls or None, name=self.tool_name, tool_call_id=self.tool_call_id)


def refuse_images(images: list[Any] | None, where: str) -> None:
    if images:
        raise APIError(400, f"{where}: images are not supported: this server serves text-only models. "
                       "Send text only.", param=where)


class _GenerationRequest(_Lenient):
    """What /api/chat and /api/generate share."""

    model: str | None = None
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    keep_alive: str | float | None = None  # how long the model stays loaded after this request (several models)
    think: bool | ThinkLevel | None = None
    logprobs: bool = False

    def check_common(self) -> None:
        if self.logprobs:
            raise APIError(400, "logprobs are not supported on the Ollama API; use /v1/chat/completions.",
                           param="logprobs")

    def response_format(self) -> ResponseFormat | None:
        """`format`: "json" (any JSON object) or a JSON schema, as response_format on /v1."""
        if not self.format:
            return None
        if self.format == "json":
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="format", schema=self.format))

    def template_kwargs(self) -> dict[str, Any]:
        """`think` -> the template's thinking switch: false turns it off, true or a level turns it on (a level
        also reaches the template as `reasoning_effort`, which gpt-oss-style templates read; "max" is "high", as
        Ollama maps it); left out, the template's default."""
        if self.think is None:
            return {}
        if self.think is False:
            return {"enable_thinking": False}
        kwargs: dict[str, Any] = {"enable_thinking": True}
        if isinstance(self.think, str):
            kwargs["reasoning_effort"] = "high" if self.think == "max" else self.think
        return kwargs


class ChatRequest(_GenerationRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None

    def chat_messages(self) -> list[ChatMessage]:
        return [m.chat_message(f"messages[{i}]") for i, m in enumerate(self.messages)]


class GenerateRequest(_GenerationRequest):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    raw: bool = False
    context: list[int] | None = None
    images: list[Any] | None = None

    def check(self) -> None:
        self.check_common()
        refuse_images(self.images, "images")
        if self.template:
            raise APIError(400, "template overrides are not supported: the model's own chat template is used "
                           "(or none, with raw).", param="template")
        if self.context:
            raise APIError(400, "context (a previous generate's token memory) is not supported; send the "
                           "conversation to /api/chat instead.", param="context")
        if self.raw and self.system:
            raise APIError(400, "raw mode does not support template, system, or context", param="system")

    @property
    def templated(self) -> bool:
        """The prompt goes through the chat template: not in raw mode, and not with a suffix (fill-in-the-middle
        lays the prompt and the suffix out itself)."""
        return not self.raw and not self.suffix


class EmbedRequest(_Lenient):
    model: str | None = None
    input: Any = None
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: str | float | None = None


class EmbeddingsRequest(_Lenient):
    model: str | None = None
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | float | None = None


class ModelRequest(_Lenient):
    """/api/show, /api/pull, /api/delete: the model by `model` (or the deprecated `name`)."""

    model: str = ""
    name: str = ""
    stream: bool = True
    verbose: bool = False

    @property
    def model_name(self) -> str:
        self.require_model()
        return self.model or self.name

    def require_model(self) -> None:
        if not (self.model or self.name):
            raise APIError(400, "model is required", param="model")


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m"); 0 unloads right
    after the request, a negative value keeps the model loaded; None leaves the model's keep-alive as it is."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise APIError(400, f"keep_alive {value!r} is not a duration; use seconds or e.g. \"5m\", \"1h\", \"-1\"",
                       param="keep_alive")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)
