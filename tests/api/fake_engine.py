"""A scripted engine implementing server.engine.protocol.ServingEngine, for API tests without a model.

A `Script` says what the next requests stream: text pieces (one token each), delays, a gate the first token
waits for, an error after k pieces. The engine records prompts, params, renders and aborts, and draws fresh
random logprobs (kept in `emitted_logprobs`) so tests compare the wire output against what it produced.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.engine.types import (
    ContextLengthExceededError,
    EngineStats,
    InfillPrompt,
    InvalidRequestError,
    ModelDescription,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
    TopLogprob,
)


@dataclass
class Script:
    pieces: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    delay_s: float = 0.0  # before each piece
    gate: threading.Event | None = None  # the first piece waits until it is set
    error_after: int | None = None  # raise after this many pieces
    finish_reason: str = "stop"
    stop_string: str | None = None  # the stop string the final delta reports
    cached_tokens: int = 0
    abort_yields_final: bool = True  # after abort(): one final "abort" delta, or just end


class FakeHandle:
    def __init__(self, engine: FakeEngine, request_id: str, script: Script, params: SamplingParams, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._script = script
        self._params = params
        self._aborted = asyncio.Event()
        self._finished = False
        self.max_model_len_left = engine.max_model_len - prompt_tokens

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._run()

    def forward(self, sink) -> None:
        """The protocol's push delivery, driven by a task over the scripted stream."""

        async def pump() -> None:
            try:
                async for delta in self._run():
                    sink(delta)
                    if delta.finish_reason is not None:
                        break
            except Exception as exc:
                sink(exc)
                return
            sink(None)

        self._pump = asyncio.ensure_future(pump())

    async def abort(self) -> None:
        if not self._aborted.is_set() and not self._finished:
            self._engine.aborted.append(self.request_id)
        self._aborted.set()

    async def _wait(self, delay_s: float) -> bool:
        """Sleep; True when aborted meanwhile."""
        try:
            await asyncio.wait_for(self._aborted.wait(), delay_s)
        except TimeoutError:
            pass
        return self._aborted.is_set()

    async def _run(self) -> AsyncIterator[StreamDelta]:
        engine, script, params = self._engine, self._script, self._params
        engine.running.add(self.request_id)
        try:
            if script.gate is not None:
                while not script.gate.is_set() and not self._aborted.is_set():
                    await self._wait(0.005)
            max_tokens = min(params.max_tokens, self.max_model_len_left)
            num_pieces = min(len(script.pieces), max_tokens)
            for i in range(num_pieces):
                if await self._wait(script.delay_s):
                    break
                if script.error_after is not None and i >= script.error_after:
                    raise RuntimeError("scripted engine failure")
                last = i == num_pieces - 1
                finish = None
                if last:
                    finish = "length" if len(script.pieces) > max_tokens else script.finish_reason
                self._finished = last
                yield self._delta(i, script.pieces[i], finish)
            else:
                if num_pieces == 0:
                    self._finished = True
                    yield self._delta(0, "", script.finish_reason)
                return
            if script.abort_yields_final:
                yield StreamDelta(self.request_id, "", [], finish_reason="abort", prompt_tokens=self.prompt_tokens)
        finally:
            engine.running.discard(self.request_id)

    def _delta(self, i: int, text: str, finish: str | None) -> StreamDelta:
        token_ids = [1000 + i] if text or finish is None else []
        logprobs = None
        if self._params.logprobs is not None and token_ids:
            rng = self._engine.rng
            top = [TopLogprob(2000 + k, f"t{k}", -rng.random() * 5) for k in range(self._params.logprobs)]
            logprobs = [TokenLogprob(token_ids[0], text, -rng.random() * 5, top)]
            self._engine.emitted_logprobs.setdefault(self.request_id, []).extend(logprobs)
        return StreamDelta(
            self.request_id, text, token_ids, finish_reason=finish, prompt_tokens=self.prompt_tokens,
            completion_tokens=i + 1 if token_ids else i, cached_tokens=self._script.cached_tokens, logprobs=logprobs,
            stop_string=self._script.stop_string if finish == "stop" else None,
        )


class FakeEngine:
    """Prompt tokens = whitespace-separated words (or the ids given); the chat template is a readable toy."""

    def __init__(self, script: Script | None = None, *, max_model_len: int = 4096, model_name: str = "fake-model"):
        self.script = script or Script()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = 5000
        self.submit_error: Exception | None = None
        # render_chat and submit wait for it while it is given and not set: they stand for slow work on large input
        self.input_gate: threading.Event | None = None
        self.num_gated = 0  # calls that reached the gate
        self.num_waiting = 0
        self.stats_calls = 0
        self.compile_state = "off"
        self.started = self.shut_down = False
        self.submitted: list[tuple[str, str | list[int], SamplingParams]] = []
        self.rendered: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.emitted_logprobs: dict[str, list[TokenLogprob]] = {}
        self.rng = random.Random()

    @property
    def is_ready(self) -> bool:
        return self.started and not self.shut_down

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        self._wait_for_input_gate()
        self.rendered.append({"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                              "kwargs": template_kwargs})
        lines = [f"<|{m['role']}|> {m['content']}" for m in messages]
        if tools:
            lines.insert(0, "<|tools|> " + json.dumps(tools))
        prompt = "\n".join(lines)
        if add_generation_prompt:
            prompt += "\n<|assistant|>"
            if template_kwargs.get("enable_thinking"):
                prompt += " <think>\n"
        return prompt

    async def embed(self, prompts: list[str | list[int]], dimensions: int | None = None) -> tuple[list[list[float]], int]:
        raise InvalidRequestError(f"the served model {self.model_name} is not an embedding model.", param="model",
                                  code="model_not_embedding")

    def count_tokens(self, prompt: str) -> int:
        return len(prompt.split())

    def describe(self) -> ModelDescription:
        return ModelDescription(
            model_type="fake", parameter_count=1_234_567, weight_bytes=4_938_268, dtype="bfloat16", quantization=None,
            max_model_len=self.max_model_len, device="cpu", hidden_size=64, num_layers=2, vocab_size=self.vocab_size,
            chat_template="{{ messages }} {% if tools %}tools{% endif %} {% if enable_thinking %}<think>{% endif %}",
            embedding=False,
        )

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> FakeHandle:
        params.validate(self.vocab_size)
        self._wait_for_input_gate()
        if isinstance(prompt, InfillPrompt):  # as a model whose tokenizer has no FIM tokens
            raise InvalidRequestError("this model cannot fill in the middle: its tokenizer has no FIM tokens",
                                      param="suffix", code="fim_not_supported")
        if isinstance(prompt, str):
            prompt.encode("utf-8")  # a real tokenizer cannot encode lone surrogates either
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if prompt_tokens >= self.max_model_len:  # a prompt that fits is accepted; generation stops at the limit
            raise ContextLengthExceededError(prompt_tokens, self.max_model_len)
        if self.submit_error is not None:
            raise self.submit_error
        request_id = request_id or f"fake-{len(self.submitted)}"
        self.submitted.append((request_id, prompt, params))
        return FakeHandle(self, request_id, self.script, params, prompt_tokens)

    def _wait_for_input_gate(self) -> None:
        if self.input_gate is not None:
            self.num_gated += 1
            assert self.input_gate.wait(30), "the input gate was never opened"

    async def stream(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        handle = self.submit(prompt, params, request_id)
        try:
            async for delta in handle:
                yield delta
        finally:
            await handle.abort()

    def stats(self) -> EngineStats:
        self.stats_calls += 1
        used = 3 * len(self.running)
        return EngineStats(num_waiting=self.num_waiting, num_running=len(self.running), kv_blocks_used=used,
                           kv_blocks_free=100 - used, prefix_cache_hit_tokens=7 * len(self.submitted),
                           compile_state=self.compile_state, bits_per_weight=4.5)

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
