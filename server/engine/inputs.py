"""A request's input: the prompt (text, a rendered chat, or token ids) tokenized and validated against the model's
vocabulary and context, its structured-output grammar compiled, and the scheduler's Request made."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from server.engine.grammar import Grammars
from server.engine.request import Request
from server.engine.tokenizer import Tokenizer
from server.engine.types import ChatPrompt, ContextLengthExceededError, InvalidRequestError, SamplingParams


class Inputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.grammars = Grammars(tokenizer, vocab_size)

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams,
                     request_id: str | None = None) -> Request:
        """Tokenize and validate; raises InvalidRequestError / ContextLengthExceededError."""
        params.validate(self.vocab_size)
        prompt_ids = self.prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            num_tokens = len(prompt_ids)
            # the exception's traceback keeps this frame: without the list in it, a refusal retains no tokens
            del prompt_ids
            raise ContextLengthExceededError(num_tokens, self.max_model_len)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(62),
            stop_token_ids=frozenset(stop_ids),
            max_total_tokens=min(len(prompt_ids) + params.max_tokens, self.max_model_len),
            grammar=grammar,
        )

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of a prompt (text or ids); one that cannot fit is refused on its length alone, before
        tokenizing; raises InvalidRequestError when empty or outside the vocab."""
        if isinstance(prompt, str):
            prompt_ids = self.encode_prompt(prompt)
        else:
            if len(prompt) >= self.max_model_len:
                raise ContextLengthExceededError(len(prompt), self.max_model_len)
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size][:5]
            if bad:
                raise InvalidRequestError(f"prompt token ids {bad} are outside the vocabulary [0, {self.vocab_size}).", param="prompt")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
        return prompt_ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a text prompt; a ChatPrompt already holds its special tokens, so none are added."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids", param="prompt")
        min_tokens = self.tokenizer.min_num_tokens(prompt)
        if min_tokens >= self.max_model_len:
            raise ContextLengthExceededError(min_tokens, self.max_model_len, at_least=True)
        return self._encode(prompt)

    def count_tokens(self, prompt: str) -> int:
        """Tokens of a text prompt of any length: clients count to decide when to compact, so no context check
        (the request body limit bounds the work)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids", param="prompt")
        return len(self._encode(prompt))

    def _encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=not isinstance(prompt, ChatPrompt))

    def chat_prompt(self, messages: list[dict[str, Any]], tools=None, **template_kwargs) -> ChatPrompt:
        """The chat template rendered with the generation prompt."""
        return ChatPrompt(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                             **template_kwargs))
