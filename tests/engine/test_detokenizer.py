"""Incremental detokenization (never a broken UTF-8 character, same text as a full decode, small windows)
and stop strings with hold-back (a partial stop string is never emitted), on fresh random inputs."""

from __future__ import annotations

import json
import random
import secrets
import unicodedata

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from server.engine.demo import TRAINING_TEXT, ensure_demo_model
from server.engine.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, StopStringMatcher
from server.engine.tokenizer import Tokenizer
from tests.helpers import random_text

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_demo_model(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def rng() -> random.Random:
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return random.Random(seed)


def chunks(rng: random.Random, items: list, max_size: int = 4) -> list[list]:
    out, i = [], 0
    while i < len(items):
        size = rng.randint(1, max_size)
        out.append(items[i : i + size])
        i += size
    return out


def stream(detok: IncrementalDetokenizer, pieces: list[list[int]]) -> list[str]:
    return [detok.add(p) for p in pieces] + [detok.flush()]


def test_multibyte_text_never_streams_broken_characters(tok, rng):
    num_split_chars = 0
    for _ in range(150):
        text = unicodedata.normalize("NFC", random_text(rng))
        ids = tok.encode(text, add_special_tokens=False)
        num_split_chars += sum(FFFD in tok.decode([i]) for i in ids)
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = [detok.add(p) for p in chunks(rng, ids, max_size=rng.choice([1, 3]))]
            assert all(FFFD not in p for p in pieces), (text, pieces)
            assert detok.flush() == ""  # valid text: nothing is left held back
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            if not skip:
                assert "".join(pieces) == text
    assert num_split_chars > 50  # the test really fed characters split across tokens


def test_emoji_split_across_tokens_comes_out_whole(tok):
    text = "a 🦜🧬 b 鸚鵡"  # characters absent from the demo's training text: one token per byte
    ids = tok.encode(text)
    assert len(ids) > len(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert all(any(ch in p for p in pieces) for ch in "🦜🧬鸚鵡") and "".join(pieces) == text
    assert all(FFFD not in p for p in pieces)
    # held back exactly while the text so far ends inside a character
    num_unfinished = sum(tok.decode(ids[: k + 1]).endswith(FFFD) for k in range(len(ids)))
    assert num_unfinished >= 8 and pieces.count("") == num_unfinished


def test_random_token_streams_equal_full_decode(tok, rng):
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 50))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = stream(detok, chunks(rng, ids))
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


def test_prompt_context(tok, rng):
    for _ in range(100):
        prompt = tok.encode(random_text(rng))
        ids = tok.encode(unicodedata.normalize("NFC", random_text(rng)), add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        pieces = stream(detok, chunks(rng, ids))
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert all(FFFD not in p for p in pieces)
    # a prompt that ends inside a character: the output's first bytes complete nothing visible
    half_emoji = tok.encode("x 🦜")[:-2]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=half_emoji)
    tail = tok.encode("🦜")[-2:] + tok.encode(" ok")
    assert "".join(stream(detok, [[i] for i in tail])) == tok.decode(tail)


def test_decode_windows_stay_small(tok, rng):
    """O(1) work per token: every decode call sees a few tokens, however long the output grows."""
    ids = tok.encode(" ".join(random_text(rng) for _ in range(60)), add_special_tokens=False)
    assert len(ids) > 1000
    seen: list[int] = []
    original = tok.decode

    def spy(token_ids, skip_special_tokens=False):
        seen.append(len(token_ids))
        return original(token_ids, skip_special_tokens)

    detok = IncrementalDetokenizer(tok, prompt_token_ids=ids[:50])
    detok.tokenizer = type("Spy", (), {"decode": staticmethod(spy)})()
    out = "".join(stream(detok, [[i] for i in ids]))
    assert out == original(ids, skip_special_tokens=True)
    assert max(seen) <= PROMPT_CONTEXT_TOKENS + 2 * MAX_HELD_TOKENS


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2 style BPE: "▁" for spaces, <0xNN> byte-fallback tokens in the vocab, and a decoder that
    strips the first space of the text."""
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained = Backend(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trained.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def test_leading_space_decoders(rng):
    """SentencePiece decoders drop the first space of a string: the window's prefix keeps later words' spaces."""
    sp = sentencepiece_style_tokenizer()
    words = sp.encode("the model 🦜 token", add_special_tokens=False)
    assert "".join(sp.decode([i]) for i in words) != sp.decode(words)  # per-token decoding loses the spaces
    assert sp.decode(words) == "the model 🦜 token"  # the emoji goes through <0xNN> byte fallback
    assert b"".join(sp.token_bytes(i) for i in words) == " the model 🦜 token".encode()  # logprob bytes
    assert "".join(sp.token_text(i) for i in sp.encode("model", add_special_tokens=False)) == " model"
    for _ in range(100):
        text = random_text(rng).replace("<", "")
        ids = sp.encode(text, add_special_tokens=False)
        pieces = stream(IncrementalDetokenizer(sp), chunks(rng, ids))
        assert "".join(pieces) == sp.decode(ids, skip_special_tokens=True), text
        # after a prompt, the first word keeps its space: the text continues the prompt
        prompt = sp.encode("Once upon a time", add_special_tokens=False)
        out = "".join(stream(IncrementalDetokenizer(sp, prompt_token_ids=prompt), chunks(rng, ids)))
        context = prompt[-PROMPT_CONTEXT_TOKENS:]
        assert out == sp.decode(context + ids)[len(sp.decode(context)) :]


# ---------------------------------------------------------------------- stop strings


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """Character by character: the first point where some stop string is complete; of those ending
    there, the longest. Independent of StopStringMatcher's buffer logic."""
    stop = [s for s in stop if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end if include else end - len(s)], True
    return text, False


def run_matcher(text: str, stop: list[str], include: bool, rng: random.Random) -> tuple[str, bool]:
    matcher = StopStringMatcher(stop, include_stop_str_in_output=include)
    expected, expect_stop = reference_stop(text, stop, include)
    emitted, consumed, stopped = "", "", False
    for piece in chunks(rng, list(text), max_size=rng.choice([1, 2, 5, 20])):
        piece = "".join(piece)
        consumed += piece
        out, stopped = matcher.push(piece)
        emitted += out
        # never emit anything the final answer does not contain: no unconfirmed stop-string prefix
        assert expected.startswith(emitted), (text, stop, emitted)
        if stopped:
            assert matcher.push("more text") == ("", True)
            break
        assert emitted + matcher.held == consumed  # nothing lost, only held
        assert len(matcher.held) < max(len(s) for s in stop if s)
    if not stopped:
        emitted += matcher.flush()
    assert (emitted, stopped) == (expected, expect_stop), (text, stop)
    return emitted, stopped


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_random_chunkings(rng, include):
    num_stopped = 0
    for _ in range(400):
        alphabet = rng.choice(["ab", "abc", "ab\n中🙂"])
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.5:
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(stop) + text[at:]
        num_stopped += run_matcher(text, stop, include, rng)[1]
    assert num_stopped > 100


def test_stop_string_split_across_many_pieces(rng):
    matcher = StopStringMatcher(["</answer>"])
    outputs = [matcher.push(ch) for ch in "The answer is 42</answ"]
    assert "".join(o for o, _ in outputs) == "The answer is 42" and not any(s for _, s in outputs)
    assert matcher.push("er>") == ("", True)
    assert matcher.flush() == ""


def test_partial_stop_released_when_it_does_not_complete(rng):
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("OR") == ("STOR", False)
    assert matcher.push("Y\n") == ("Y", False)
    assert matcher.push("x") == ("\nx", False)
    assert matcher.push(" ST") == (" ", False)
    assert matcher.flush() == "ST"  # a finish by length or EOS releases the held text


def test_multiple_stops_and_include(rng):
    text = "alpha beta gamma delta"
    for include in (False, True):
        out, stopped = run_matcher(text, ["gamma", "beta", "zeta"], include, rng)
        assert stopped and out == ("alpha beta" if include else "alpha ")


def test_empty_stop_strings_are_ignored(rng):
    matcher = StopStringMatcher(["", ""])
    text = random_text(rng)
    assert matcher.push(text) == (text, False) and matcher.flush() == ""
