"""Public engine types: what the API layer and Python users see. No torch here.

The HTTP layer imports only this module (and `server.engine.protocol`), so it can be tested against a
scripted fake engine and never pulls torch in by itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class EngineError(Exception):
    """Base class of errors raised by the engine."""


class InvalidRequestError(EngineError, ValueError):
    """A request the caller must fix. `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    """The prompt leaves no room to generate. (A prompt that fits but whose prompt + max_tokens does not
    is accepted; generation stops at the limit with finish_reason "length".)"""

    def __init__(self, prompt_len: int, max_model_len: int, *, at_least: bool = False):
        """`at_least`: prompt_len is a lower bound, found without tokenizing a prompt far too long to fit."""
        counted = f"at least {prompt_len}" if at_least else str(prompt_len)
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, your messages resulted in "
            f"{counted} tokens, which leaves no room for the completion. Please reduce the length of the messages."
        )
        super().__init__(msg, param="messages", code="context_length_exceeded")
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class QueueFullError(EngineError):
    """The waiting queue is full; the caller should retry later."""

    def __init__(self, num_waiting: int, retry_after_s: float = 1.0):
        super().__init__(f"The server is busy: {num_waiting} requests are already waiting. Retry later.")
        self.retry_after_s = retry_after_s


class StepFailedError(EngineError):
    """One engine step raised: the requests it held are ended (their blocks freed); the engine serves on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine failed in a step ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids


class ModelLoadError(EngineError):
    """A checkpoint could not be found or loaded; the message names the file or tensor."""


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the structured output's grammar could not go on (StreamDelta.error says why)


# The reasoning section's markers, as thinking chat templates write them (Qwen3, DeepSeek-R1)
THINK_START = "<think>"
THINK_END = "</think>"

# JSON as models write it on one line: no whitespace choices to spend tokens on
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict[str, Any] | None) -> str:
    """A Lark grammar expression matching JSON valid against `schema` (None: any JSON object)."""
    body = dict(schema) if schema is not None else {"type": "object"}
    body["x-guidance"] = JSON_STYLE
    return "%json " + json.dumps(body, ensure_ascii=False)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text: an llguidance Lark grammar (`start` is its root; JSON schemas embed
    as `%json {...}`, see json_rule). Rules `markerK` and `upto_markerK` (any text, then the marker) stand for
    `markers[K]`; the engine spells each as the tokenizer does (one special token, or plain text). `param`
    names the request field the constraint comes from, in errors."""

    grammar: str
    markers: tuple[str, ...] = ()
    param: str = "response_format"

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | None = None, param: str = "response_format") -> StructuredOutput:
        """The whole output is JSON valid against `schema` (None: any JSON object)."""
        return cls(f"start: {json_rule(schema)}\n", param=param)


MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 256


@dataclass
class SamplingParams:
    """Per-request generation settings. `validate()` raises InvalidRequestError with a fix-it message."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 selects greedy decoding
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None  # None: off; 0: the sampled token only; n: also the top n
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # the output follows this grammar; compiled by the engine
    reasoning_budget: int | None = None  # the reasoning ends by this many tokens: the engine then writes `</think>`
    # the prediction phase's time budget, counted from the first generated token: once it has passed, the request
    # ends with finish_reason "length" (llama.cpp's t_max_predict_ms, without its wait for a newline)
    max_predict_ms: float | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1 (an integer), got {self.max_tokens!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            bad("top_k", f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                bad(name, f"{name} must be in [-2, 2], got {value}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"logprobs must be between 0 and 20, got {self.logprobs}.")
        budget = self.reasoning_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            bad("reasoning_budget", f"reasoning_budget must be a positive number of tokens, got {budget!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"seed must be an integer, got {self.seed!r}.")
        self._validate_sizes(bad)
        for token_id, bias in (self.logit_bias or {}).items():
            if vocab_size is not None and not 0 <= int(token_id) < vocab_size:
                bad("logit_bias", f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size}).")
            if not -100 <= bias <= 100:
                bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.")
        if self.max_predict_ms is not None and not (math.isfinite(self.max_predict_ms) and self.max_predict_ms > 0):
            bad("max_predict_ms", f"the time budget must be a positive number of milliseconds, got {self.max_predict_ms}.")
        for token_id in self.stop_token_ids:
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                bad("stop_token_ids", f"stop token id {token_id} is outside the vocabulary [0, {vocab_size}).")

    def _validate_sizes(self, bad) -> None:
        """Caps on what costs work per generated token (stop strings are searched in every new piece of text)."""
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(self.stop)}.")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            bad("stop", f"stop sequences may be at most {MAX_STOP_CHARS} characters long, got one of {len(longest)}.")
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got "
                f"{len(self.stop_token_ids)}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The final result of `Engine.generate` / `Engine.chat`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error" (a grammar that could not go on)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StreamDelta:
    """One increment of a streamed request: new text (never a broken UTF-8 character, never part of a
    stop string) and the tokens that produced it. The last delta has `finish_reason` set."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None  # the stop string that ended the request (finish_reason "stop"), if one did
    error: InvalidRequestError | None = None  # finish_reason "error": why (the output's grammar could not go on)


@dataclass
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from reused KV since start (memory or disk)
    prefix_cache_disk_hit_tokens: int = 0  # of those, read from the disk tier
    prefix_cache_miss_tokens: int = 0  # prompt tokens computed
    prefix_cache_disk_bytes: int = 0  # files of the disk tier
    prefix_cache_disk_writes_dropped: int = 0  # evicted blocks not written: the write queue was full
    prompt_tokens: int = 0
    generation_tokens: int = 0
    compile_state: str = "off"  # Engine.compile_state, one of COMPILE_STATES
    bits_per_weight: float = 0.0  # resident bits per model weight (engine/weights.bits_per_weight); 0: unknown


@dataclass(frozen=True)
class ModelDescription:
    """What the served checkpoint is, for the APIs that describe it (Ollama's /api/show, /api/tags, /api/ps)."""

    model_type: str
    parameter_count: int  # weights the model stands for (packed ones counted unpacked)
    weight_bytes: int  # resident on the device
    dtype: str  # e.g. "bfloat16"
    quantization: str | None  # "fp8", "int8", "int4", "mlx" (an MLX checkpoint as published), None
    max_model_len: int
    device: str  # "mps", "cuda", "cpu"
    hidden_size: int
    num_layers: int
    vocab_size: int
    chat_template: str | None  # the Jinja template, or None
    embedding: bool  # a sentence-transformers embedding checkpoint (Pooling module)


# The compiled steps: nothing to compile; compiled on first use; being built beside serving; in use; failed
# (serving stays on the eager path)
COMPILE_STATES = ("off", "lazy", "compiling", "ready", "failed")


@dataclass(frozen=True)
class InfillFile:
    """One file of repository context for a fill-in-the-middle prompt (llama.cpp's input_extra item)."""

    filename: str
    text: str


@dataclass(frozen=True)
class InfillPrompt:
    """A fill-in-the-middle prompt: the text before the cursor, the text after it, and optionally other files of
    the repository as context. The engine lays it out with the model's own FIM tokens (engine.fim) and refuses it
    when the tokenizer has none. Submit it wherever a prompt goes (`submit`, `generate`)."""

    prefix: str
    suffix: str
    files: tuple[InfillFile, ...] = ()

    def texts(self) -> list[str]:
        """Every piece of text it carries (for sizing the work of tokenizing it)."""
        return [self.prefix, self.suffix, *(f.filename for f in self.files), *(f.text for f in self.files)]


class ChatPrompt(str):
    """Text rendered by the model's chat template (`render_chat`). The template already placed every special
    token, so the engine encodes it without adding BOS again, as transformers' apply_chat_template does."""
