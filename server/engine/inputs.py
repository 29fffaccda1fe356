"""A request's input: the prompt (text, a rendered chat, or token ids) tokenized and validated against the model's
vocabulary and context, its structured-output grammar compiled, and the scheduler's Request made."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from server.engine.fim import FimTokens, infill_ids
from server.engine.grammar import Grammars
from server.engine.reasoning_budget import ReasoningBudget
from server.engine.request import Request
from server.engine.tokenizer import Tokenizer
from server.engine.types import (
    ChatPrompt,
    ContextLengthExceededError,
    InfillPrompt,
    InvalidRequestError,
    SamplingParams,
)

Prompt = str | Sequence[int] | InfillPrompt


class Inputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.grammars = Grammars(tokenizer, vocab_size)
        self.fim = FimTokens.find(tokenizer.backend.token_to_id) if tokenizer is not None else None

    def make_request(self, prompt: Prompt, params: SamplingParams,
                     request_id: str | None = None) -> Request:
        """Tokenize and validate; raises InvalidRequestError / ContextLengthExceededError."""
        params.validate(self.vocab_size)
        prompt_ids = self.infill_prompt_ids(prompt, params) if isinstance(prompt, InfillPrompt) else self.prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            num_tokens = len(prompt_ids)
            # the exception's traceback keeps this frame: without the list in it, a refusal retains no tokens
            del prompt_ids
            raise ContextLengthExceededError(num_tokens, self.max_model_len)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        reasoning = None
        if params.reasoning_budget is not None and self.tokenizer is not None:
            reasoning = ReasoningBudget.for_prompt(params.reasoning_budget, self.tokenizer, prompt_ids)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
            if isinstance(prompt, InfillPrompt):
                stop_ids |= self.fim.stop_ids
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(62),
            stop_token_ids=frozenset(stop_ids),
            max_total_tokens=min(len(prompt_ids) + params.max_tokens, self.max_model_len),
            grammar=grammar,
            reasoning=reasoning,
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

    def infill_prompt_ids(self, prompt: InfillPrompt, params: SamplingParams) -> list[int]:
        """A fill-in-the-middle prompt laid out with the model's FIM tokens (engine.fim). Repository context is cut
        from its start to leave room for max_tokens (at most a quarter of the context); prefix and suffix are not."""
        if self.fim is None:
            raise InvalidRequestError(
                "this model cannot fill in the middle: its tokenizer has no FIM tokens (such as Qwen2.5-Coder's "
                "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); serve a code model trained for fill-in-the-middle, "
                "or send the prompt without a suffix", param="suffix", code="fim_not_supported")
        min_tokens = self.tokenizer.min_num_tokens(prompt.prefix) + self.tokenizer.min_num_tokens(prompt.suffix)
        if min_tokens >= self.max_model_len:
            raise ContextLengthExceededError(min_tokens, self.max_model_len, at_least=True)
        max_prompt_tokens = self.max_model_len - min(params.max_tokens, self.max_model_len // 4)
        return infill_ids(self.fim, prompt, self._encode_piece, self._bos(), max_prompt_tokens)

    def _encode_piece(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _bos(self) -> list[int]:
        """[BOS] where the tokenizer adds it to every text, else []."""
        bos = self.tokenizer.bos_token_id
        return [bos] if bos is not None and self.tokenizer.encode("")[:1] == [bos] else []

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
