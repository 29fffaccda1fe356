"""Prompts far too long for the context are refused before tokenizing; the bound never refuses one that fits."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from server.engine.engine import Engine
from server.engine.tokenizer import Tokenizer
from server.engine.types import ContextLengthExceededError, SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("demo", device="cpu")


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(engine, monkeypatch) -> None:
    limit = engine.max_model_len * engine.tokenizer.max_chars_per_token
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(ContextLengthExceededError, match=r"resulted in at least \d+ tokens") as info:
        engine.inputs.make_request("x" * limit, SamplingParams())
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceededError, match=f"resulted in {engine.max_model_len} tokens"):
        engine.inputs.make_request([1] * engine.max_model_len, SamplingParams())


def test_a_prompt_under_the_bound_is_tokenized_and_counted(engine) -> None:
    limit = engine.max_model_len * engine.tokenizer.max_chars_per_token
    text = "word " * (limit // 10)  # half the cheap bound, yet more tokens than the context holds
    with pytest.raises(ContextLengthExceededError, match=r"resulted in \d+ tokens") as info:
        engine.inputs.make_request(text, SamplingParams())
    assert info.value.prompt_len == len(engine.tokenizer.encode(text))


def test_the_bound_is_below_the_true_count(engine) -> None:
    tok = engine.tokenizer
    longest = max(tok.backend.get_vocab(with_added_tokens=True), key=len)
    rng = random.Random(0)
    texts = [tok.decode([tok.backend.token_to_id(longest)]) * 300, " " * 5000, "\n\n\t " * 999,
             "".join(chr(rng.randrange(32, 0x3000)) for _ in range(4000)), "e\u0301" * 2000, "\u1100\u1161\u11a8" * 900]
    for text in texts:
        assert 0 < tok.min_num_tokens(text) <= len(tok.encode(text))


def test_a_tokenizer_that_drops_whitespace_has_no_bound() -> None:
    backend = Backend(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(backend)
    assert tok.max_chars_per_token is None and tok.min_num_tokens(" " * 10**6) == 0
