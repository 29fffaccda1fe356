"""What the HTTP layer needs from an engine. `AsyncEngine` implements it; API tests use a scripted fake."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from server.engine.types import EngineStats, InfillPrompt, ModelDescription, SamplingParams, StreamDelta


class RequestHandle(Protocol):
    request_id: str
    prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[StreamDelta]: ...

    def forward(self, sink: Callable[[StreamDelta | BaseException | None], None]) -> None:
        """Instead of iterating: hand each item to `sink` on the event loop as it arrives, each delta, then None
        once the stream ends (after the final delta, or without one after an abort); an exception raised by
        the request is handed over instead and ends it. Saves the HTTP layer a task and a queue hop per token."""

    async def abort(self) -> None:
        """Stop generating; the engine frees the request's KV blocks within one step."""


class ServingEngine(Protocol):
    model_name: str  # what the checkpoint was loaded from (path or Hub id)
    max_model_len: int

    @property
    def is_ready(self) -> bool: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The model's chat template applied to OpenAI-style messages (tool-call arguments already dicts).
        Thread-safe: the HTTP layer renders large conversations on a worker thread."""

    async def embed(self, prompts: list[str | list[int]], dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """(pooled embedding per prompt, number of prompt tokens). Raises InvalidRequestError when the model is
        no embedding model or an input is empty, outside the vocabulary or too long."""

    def describe(self) -> ModelDescription:
        """The served checkpoint: architecture, size, precision, chat template."""

    def count_tokens(self, prompt: str) -> int:
        """How many tokens `prompt` (e.g. a render_chat result) is, as submit() would encode it."""

    def submit(self, prompt: str | list[int] | InfillPrompt, params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        """Queue a request (an InfillPrompt: fill in the middle). Raises InvalidRequestError (incl. ContextLengthExceededError) or QueueFullError
        synchronously, before anything is streamed. Thread-safe once start() ran: the HTTP layer tokenizes large
        prompts on a worker thread."""

    def stream(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """submit() + iterate; leaving the loop early aborts the request."""

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
