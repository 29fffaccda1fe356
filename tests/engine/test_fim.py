"""Fill-in-the-middle in the engine: FIM tokens found in each family's vocabulary, the prompt's token layout written
out here by hand from the tokenizer, repository context and its cut, refusals, and the prediction time budget."""

from __future__ import annotations

import random

import pytest
from tokenizers import processors

from server.engine.demo import build_tokenizer
from server.engine.fim import CURRENT_FILE, REPO_NAME, FimTokens
from server.engine.inputs import Inputs
from server.engine.tokenizer import Tokenizer
from server.engine.types import InfillFile, InfillPrompt, InvalidRequestError, SamplingParams
from tests.helpers import QWEN_CODER_TOKENS, byte_tokenizer, make_engine, random_text

# per family: (prefix, suffix, middle, pad, repo, file_sep, end), None where the family has no such token
FAMILIES = {
    "qwen-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>", "<|endoftext|>"),
    "starcoder2": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<repo_name>", "<file_sep>",
                   "<|endoftext|>"),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None, None, "▁<EOT>"),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None, "<｜end▁of▁sentence｜>"),
}


def _family_tokenizer(family: str, rng: random.Random):
    """A byte tokenizer with the family's tokens added in a random order among distractors."""
    added = [t for t in FAMILIES[family] if t is not None] + ["<|im_start|>", "<unrelated>"]
    rng.shuffle(added)
    return byte_tokenizer(tuple(added))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_fim_tokens_are_found_in_the_vocabulary(family: str) -> None:
    rng = random.Random()
    backend = _family_tokenizer(family, rng)
    ids = [backend.token_to_id(t) if t is not None else None for t in FAMILIES[family]]
    fim = FimTokens.find(backend.token_to_id)
    assert (fim.prefix, fim.suffix, fim.middle, fim.pad, fim.repo, fim.file_sep) == tuple(ids[:6])
    assert fim.stop_ids == {i for i in ids if i is not None}


def test_a_vocabulary_without_fim_tokens_is_refused_with_a_400_reason() -> None:
    assert FimTokens.find(build_tokenizer().token_to_id) is None  # the demo model's tokenizer
    inputs = Inputs(Tokenizer(byte_tokenizer(("<|im_end|>",))), 258, 512)
    with pytest.raises(InvalidRequestError, match="no FIM tokens") as info:
        inputs.make_request(InfillPrompt("def f(", "):"), SamplingParams())
    assert info.value.param == "suffix" and info.value.code == "fim_not_supported"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_prompt_is_prefix_suffix_middle_with_the_families_tokens(family: str) -> None:
    rng = random.Random()
    backend = _family_tokenizer(family, rng)
    inputs = Inputs(Tokenizer(backend), backend.get_vocab_size(), 4096)
    prefix, suffix = random_text(rng), random_text(rng)
    request = inputs.make_request(InfillPrompt(prefix, suffix), SamplingParams(max_tokens=4))

    def tok(name: str) -> list[int]:
        return [backend.token_to_id(name)]

    def text(s: str) -> list[int]:
        return backend.encode(s, add_special_tokens=False).ids

    pre, suf, mid, *_, end = FAMILIES[family]
    assert request.token_ids == tok(pre) + text(prefix) + tok(suf) + text(suffix) + tok(mid)
    assert backend.token_to_id(end) in request.stop_token_ids
    plain = inputs.make_request(prefix, SamplingParams(max_tokens=4))
    assert not plain.stop_token_ids & {backend.token_to_id(t) for t in FAMILIES[family] if t}


def test_repository_context_takes_the_repo_layout_and_is_cut_from_its_start() -> None:
    rng = random.Random()
    backend = byte_tokenizer(QWEN_CODER_TOKENS)
    inputs = Inputs(Tokenizer(backend), backend.get_vocab_size(), 512)
    files = tuple(InfillFile(f"src/m{i}.py", random_text(rng, 40)) for i in range(rng.randint(1, 3)))
    prompt = InfillPrompt(random_text(rng, 30), random_text(rng, 30), files)

    def tok(name: str) -> list[int]:
        return [backend.token_to_id(name)]

    def text(s: str) -> list[int]:
        return backend.encode(s, add_special_tokens=False).ids

    context = tok("<|repo_name|>") + text(REPO_NAME + "\n")
    for f in files:
        context += tok("<|file_sep|>") + text(f.filename + "\n") + text(f.text)
    context += tok("<|file_sep|>") + text(CURRENT_FILE + "\n")
    core = tok("<|fim_prefix|>") + text(prompt.prefix) + tok("<|fim_suffix|>") + text(prompt.suffix)
    core += tok("<|fim_middle|>")
    assert inputs.make_request(prompt, SamplingParams(max_tokens=8)).token_ids == context + core
    # a context too long for the window loses its start: the prompt leaves room for max_tokens (at most a quarter
    # of the window, which is more than 4 here whatever the random lengths)
    small = Inputs(Tokenizer(backend), backend.get_vocab_size(), len(core) + 20 + 4)
    cut = small.make_request(prompt, SamplingParams(max_tokens=4)).token_ids
    assert cut == context[-20:] + core


def test_without_a_file_separator_each_file_follows_a_text_separator_and_bos_comes_first() -> None:
    rng = random.Random()
    backend = _family_tokenizer("deepseek-coder", rng)
    backend.add_special_tokens(["<bos>"])
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    inputs = Inputs(Tokenizer(backend, {"bos_token": "<bos>"}), backend.get_vocab_size(), 4096)
    files = (InfillFile("a.py", random_text(rng, 20)),)
    prompt = InfillPrompt(random_text(rng, 20), random_text(rng, 20), files)
    ids = inputs.make_request(prompt, SamplingParams(max_tokens=8)).token_ids
    separator = backend.encode(f"\n\n--- a.py ---\n\n{files[0].text}", add_special_tokens=False).ids
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids[1:1 + len(separator)] == separator
    assert ids[1 + len(separator)] == backend.token_to_id("<｜fim▁begin｜>")


def test_the_time_budget_ends_a_generation_with_length(tiny_fim_checkpoint) -> None:
    engine = make_engine(tiny_fim_checkpoint[0])
    prompt = InfillPrompt(random_text(random.Random(), 20), "\n")
    free = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    budgeted = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                      max_predict_ms=1.0))
    assert free.completion_tokens == 40
    assert budgeted.finish_reason == "length" and 1 <= budgeted.completion_tokens < 40
    assert free.token_ids[:budgeted.completion_tokens] == budgeted.token_ids
    with pytest.raises(InvalidRequestError, match="positive number of milliseconds"):
        SamplingParams(max_predict_ms=0.0).validate()
