"""From sampled tokens to what callers see: per live request an incremental detokenizer, a stop-string matcher
(which holds text back until it knows it is no stop string) and the logprobs, assembled into StreamDeltas; the
deltas of a request then make its RequestOutput."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.model_runner import SampledToken
from server.engine.request import Request
from server.engine.tokenizer import Tokenizer
from server.engine.types import RequestOutput, StreamDelta, TokenLogprob, TopLogprob


class _NoText:
    """Detokenizer stand-in for engines without a tokenizer (benchmarks): outputs are token ids only."""

    def add(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class _RequestText:
    detokenizer: IncrementalDetokenizer | _NoText
    stop: StopStringMatcher
    wants_logprobs: bool
    deadline: float | None = None  # when the prediction budget ends (monotonic s), set at the first token

    def past_budget(self, budget_ms: float | None) -> bool:
        """The request's max_predict_ms has passed since its first token (the first call is that token)."""
        if budget_ms is None:
            return False
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + budget_ms / 1000
        return now >= self.deadline


class OutputAssembler:
    """`finish(request, reason)` ends a request whose text reached a stop string (the scheduler's finish)."""

    def __init__(self, tokenizer: Tokenizer | None, finish: Callable[[Request, str], None]):
        self.tokenizer = tokenizer
        self.finish = finish
        self.live: dict[str, _RequestText] = {}

    def add(self, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.token_ids) if self.tokenizer else _NoText()
        stop = StopStringMatcher(request.params.stop, request.params.include_stop_str_in_output)
        self.live[request.request_id] = _RequestText(detokenizer, stop, request.params.logprobs is not None)

    def drop(self, request_id: str) -> bool:
        """Forget a request that ends without a last token (aborted, scored); False if it was not live."""
        return self.live.pop(request_id, None) is not None

    def on_token(self, request: Request, token: SampledToken) -> StreamDelta:
        """The delta of one new token: the text it completes, none of a possible stop string's start, all that
        was held back once the request finished."""
        state = self.live[request.request_id]
        # a stop token's own text is not output (as vLLM): a non-special one (a FIM pad) would show as markup
        hidden = (request.finish_reason == "stop" and token.token_id in request.stop_token_ids
                  and not request.params.include_stop_str_in_output)
        emit, stopped = state.stop.push(state.detokenizer.add([] if hidden else [token.token_id]))
        if stopped:
            self.finish(request, "stop")
        else:
            if not request.is_finished and state.past_budget(request.params.max_predict_ms):
                self.finish(request, "length")
            if request.is_finished:
                tail, stopped = state.stop.push(state.detokenizer.flush())
                emit += tail + ("" if stopped else state.stop.flush())
        if request.is_finished:
            del self.live[request.request_id]
        logprobs = [self._logprob(token)] if state.wants_logprobs else None
        return stream_delta(request, emit, [token.token_id], logprobs, state.stop.matched)

    def _logprob(self, token: SampledToken) -> TokenLogprob:
        text = self.tokenizer.token_text if self.tokenizer else str
        top = [TopLogprob(t, text(t), lp) for t, lp in zip(token.top_ids, token.top_logprobs, strict=True)]
        return TokenLogprob(token.token_id, text(token.token_id), float(token.logprob or 0.0), top)


def stream_delta(request: Request, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                 stop_string: str | None = None) -> StreamDelta:
    return StreamDelta(
        request_id=request.request_id,
        text=text,
        token_ids=token_ids,
        finish_reason=request.finish_reason,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens,
        cached_tokens=request.num_cached_tokens,
        logprobs=logprobs,
        stop_string=stop_string,
        error=request.error,
    )


def final_output(request: Request, deltas: list[StreamDelta]) -> RequestOutput:
    """A finished request's result: the text and logprobs of all its deltas."""
    wants_logprobs = request.params.logprobs is not None
    return RequestOutput(
        request_id=request.request_id,
        text="".join(d.text for d in deltas),
        token_ids=request.output_token_ids,
        finish_reason=request.finish_reason or "abort",
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens,
        cached_tokens=request.num_cached_tokens,
        logprobs=[lp for d in deltas for lp in d.logprobs or []] if wants_logprobs else None,
    )
