"""llama.cpp's `POST /infill` (code completion in llama.vscode, Continue, ...): the request fields of llama.cpp's
server, its response object (`content`, `stop`, `stop_type`, `tokens_predicted`, ...) and its stream (one
`data:` object per piece of text, `stop: false`; a last one with `stop: true` and the totals; no `[DONE]`).

The prompt is fill-in-the-middle (engine.fim): `input_prefix` then `prompt` (the text typed on the current line,
which llama.cpp also appends to the prefix) before the cursor, `input_suffix` after it, `input_extra` files as
repository context. Errors keep this server's OpenAI shape. Fields llama.cpp takes that have no equivalent here
(`samplers`, `cache_prompt`, `id_slot`, `n_probs`, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from server.api.generation import KEEPALIVE
from server.api.routes import keepalive_s, parse_body, read_json, respond, start_generation, validate_params
from server.api.schemas import Number, StrictInt, stop_strings, time_budget
from server.api.sse import KEEPALIVE_COMMENT, sse_data
from server.api.state import ServingState
from server.api.streaming import ResponseContext, deltas
from server.engine.types import InfillFile, InfillPrompt, SamplingParams, StreamDelta

router = APIRouter()
_PARAM_NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty",
                "max_predict_ms": "t_max_predict_ms"}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InfillChunk(_Lenient):
    filename: str = "tmp"  # llama.cpp's default name
    text: str


class InfillRequest(_Lenient):
    """llama.cpp's /infill fields with its defaults."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""
    n_predict: StrictInt = -1  # -1: up to the context; 0: evaluate the prompt only
    stream: bool = False
    temperature: Number = 0.8
    top_k: StrictInt = 40
    top_p: Number = 0.95
    min_p: Number = 0.05
    stop: list[str] = []
    seed: StrictInt = -1
    t_max_predict_ms: Number = 0
    repeat_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    ignore_eos: bool = False
    return_tokens: bool = False

    def infill_prompt(self) -> InfillPrompt:
        files = tuple(InfillFile(c.filename, c.text) for c in self.input_extra)
        return InfillPrompt(prefix=self.input_prefix + self.prompt, suffix=self.input_suffix, files=files)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """As llama.cpp reads them: a temperature <= 0 is greedy, top_k <= 0 and top_p >= 1 are off, seed -1
        is random. n_predict 0 still generates one token, which the response leaves out."""
        return SamplingParams(
            max_tokens=default_max_tokens if self.n_predict < 0 else max(self.n_predict, 1),
            temperature=max(self.temperature, 0.0),
            top_k=max(self.top_k, 0),
            top_p=min(self.top_p, 1.0),
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=stop_strings(self.stop),
            seed=None if self.seed < 0 else self.seed,
            ignore_eos=self.ignore_eos,
            max_predict_ms=time_budget(self.t_max_predict_ms),
        )


class InfillRun:
    """One /infill request's output so far, rendered as llama.cpp renders its partial and final results."""

    def __init__(self, req: InfillRequest, params: SamplingParams, model: str, max_model_len: int, started_at: float):
        self.req, self.params, self.model, self.max_model_len = req, params, model, max_model_len
        self.started_at = started_at
        self.discard = req.n_predict == 0  # the prompt is evaluated, the one token generated is not shown
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.pending: list[int] = []  # tokens of text held back so far (a possible stop string)
        self.last: StreamDelta | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None

    def add(self, delta: StreamDelta) -> str | None:
        """Take one delta; the partial result to stream for it, if it carries text."""
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at, self.last = now, delta
        if self.discard:
            return None
        self.text.append(delta.text)
        self.tokens += delta.token_ids
        self.pending += delta.token_ids
        if not delta.text:
            return None
        partial = {"index": 0, "content": delta.text, "tokens": self.pending, "stop": False,
                   "tokens_predicted": len(self.tokens), "tokens_evaluated": delta.prompt_tokens}
        self.pending = []
        return sse_data(partial)

    def final(self, stream: bool) -> dict[str, Any]:
        last = self.last
        predicted = 0 if self.discard else last.completion_tokens
        content = "".join(self.text)
        return {
            "index": 0, "content": "" if stream else content,
            "tokens": [] if stream or not self.req.return_tokens else self.tokens,
            "stop": True, "model": self.model, "tokens_predicted": predicted, "tokens_evaluated": last.prompt_tokens,
            "generation_settings": self._settings(), "has_new_line": "\n" in content,
            "truncated": last.finish_reason == "length" and last.prompt_tokens + last.completion_tokens >= self.max_model_len,
            "stop_type": self._stop_type(), "stopping_word": last.stop_string or "",
            "tokens_cached": last.cached_tokens, "timings": self._timings(predicted),
        }

    def _stop_type(self) -> str:
        if self.discard or self.last.finish_reason == "length":
            return "limit"
        return "word" if self.last.stop_string else "eos"

    def _settings(self) -> dict[str, Any]:
        p = self.params
        return {"n_predict": self.req.n_predict, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "stop": p.stop,
                "t_max_predict_ms": self.req.t_max_predict_ms, "stream": self.req.stream, "model": self.model}

    def _timings(self, predicted: int) -> dict[str, Any]:
        """prompt_ms: from the request's arrival to its first token (queueing included)."""
        prompt_ms = (self.first_at - self.started_at) * 1000
        predicted_ms = (self.last_at - self.first_at) * 1000
        last = self.last
        return {"cache_n": last.cached_tokens, "prompt_n": last.prompt_tokens - last.cached_tokens,
                "prompt_ms": prompt_ms, "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_second": predicted * 1000 / predicted_ms if predicted_ms > 0 else None}


async def stream_infill(ctx: ResponseContext, run: InfillRun) -> AsyncIterator[str]:
    async for item in deltas(ctx.generation, ctx.keepalive_s):
        if item is KEEPALIVE:
            yield KEEPALIVE_COMMENT
            continue
        partial = run.add(item[1])
        if partial is not None:
            yield partial
    yield sse_data(run.final(stream=True))


async def collect_infill(ctx: ResponseContext, run: InfillRun) -> dict[str, Any]:
    async for _, delta in deltas(ctx.generation):
        run.add(delta)
    return run.final(stream=False)


@router.post("/infill")
async def infill(request: Request) -> Response:
    started_at = time.monotonic()
    state: ServingState = request.app.state.serving
    req: InfillRequest = parse_body(InfillRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(getattr(req, "model", None))
    params = req.to_sampling_params(default_max_tokens=engine.max_model_len)
    validate_params(params, _PARAM_NAMES)
    request_id = f"infill-{uuid.uuid4().hex}"
    generation = await start_generation(
        state, engine, [req.infill_prompt()], params, n=1, request_id=request_id, started_at=started_at,
        prompt_param="input_prefix", param_names={"suffix": "input_suffix", **_PARAM_NAMES},
    )
    ctx = ResponseContext(id=request_id, created=int(time.time()), model=state.served_model_name,
                          system_fingerprint=state.system_fingerprint, generation=generation,
                          keepalive_s=keepalive_s(state))
    run = InfillRun(req, params, state.served_model_name, engine.max_model_len, started_at)
    return await respond(request, state, ctx, req.stream, lambda c: stream_infill(c, run),
                         lambda c: collect_infill(c, run))
