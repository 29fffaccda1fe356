"""Fill-in-the-middle: a model's FIM tokens, read from its tokenizer's vocabulary, and the prompt laid out with them.

A code model trained for FIM reads `<PRE> prefix <SUF> suffix <MID>` (the prefix-suffix-middle order every family
below uses) and writes the middle, ending it with an end-of-text or FIM pad token. The tokens are found by their
spelling in the vocabulary or the added tokens, as llama.cpp's llama-vocab finds them, so any checkpoint that
carries one of these families' tokens works, whatever its architecture. With repository context (other files,
llama.cpp's `input_extra`) and a model that has the repository tokens, the prompt takes the repository layout:

    <repo>myproject\\n <file_sep>name\\n text ... <file_sep>filename\\n <PRE> prefix <SUF> suffix <MID>

Without them, each file's text follows a plain-text separator line. The text pieces are tokenized one by one,
with no special tokens added; a BOS comes first where the tokenizer adds one to every text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.engine.types import InfillFile, InfillPrompt

# (prefix, suffix, middle) spellings, one family per row: the first row whose three tokens all exist is taken
FIM_FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite code
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),  # SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # GLM-4.5
)
PAD_TOKENS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>")
REPO_TOKENS = ("<|repo_name|>", "<|fim_repo|>", "<repo_name>", "<reponame>", "<fim-repo>")
FILE_SEP_TOKENS = ("<|file_sep|>", "<file_sep>")
# tokens after which a middle is over, beside the model's EOS: end-of-text / end-of-turn spellings of these families
END_TOKENS = ("<|endoftext|>", "▁<EOT>", "<EOT>", "<｜end▁of▁sentence｜>", "<|im_end|>", "<|end_of_text|>",
              "<|eot_id|>")
# llama.cpp's names for the repository and for the file being edited, which requests do not carry
REPO_NAME = "myproject"
CURRENT_FILE = "filename"


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None
    ends: frozenset[int] = frozenset()

    @classmethod
    def find(cls, token_to_id: Callable[[str], int | None]) -> FimTokens | None:
        """The FIM tokens of a vocabulary (`token_to_id` looks one spelling up), or None when it has none."""
        for spellings in FIM_FAMILIES:
            ids = [token_to_id(s) for s in spellings]
            if all(i is not None for i in ids):
                return cls(*ids, pad=_first(token_to_id, PAD_TOKENS), repo=_first(token_to_id, REPO_TOKENS),
                           file_sep=_first(token_to_id, FILE_SEP_TOKENS),
                           ends=frozenset(i for s in END_TOKENS if (i := token_to_id(s)) is not None))
        return None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a middle: every FIM token (one means the model left the middle) and the end tokens."""
        own = (self.prefix, self.suffix, self.middle, self.pad, self.repo, self.file_sep)
        return self.ends | {i for i in own if i is not None}


def _first(token_to_id: Callable[[str], int | None], spellings: Sequence[str]) -> int | None:
    return next((i for s in spellings if (i := token_to_id(s)) is not None), None)


def infill_ids(fim: FimTokens, prompt: InfillPrompt, encode: Callable[[str], list[int]], bos: list[int],
               max_prompt_tokens: int) -> list[int]:
    """The prompt's token ids: BOS, the repository context, then prefix-suffix-middle. The context is cut from its
    start to keep the prompt within `max_prompt_tokens`; prefix and suffix never are. `encode` tokenizes a text
    piece without special tokens."""
    core = [fim.prefix, *encode(prompt.prefix), fim.suffix, *encode(prompt.suffix), fim.middle]
    context = repo_context(fim, prompt.files, encode)
    keep = max(0, min(len(context), max_prompt_tokens - len(bos) - len(core)))
    return [*bos, *context[len(context) - keep:], *core]


def repo_context(fim: FimTokens, files: Sequence[InfillFile], encode: Callable[[str], list[int]]) -> list[int]:
    """The tokens of the other files, in the repository layout where the model has a file separator."""
    if not files:
        return []
    if fim.file_sep is None:
        return [t for f in files for t in encode(f"\n\n--- {f.filename} ---\n\n{f.text}")]
    ids = [fim.repo, *encode(REPO_NAME + "\n")] if fim.repo is not None else []
    for f in files:
        ids += [fim.file_sep, *encode(f.filename + "\n"), *encode(f.text)]
    return ids + [fim.file_sep, *encode(CURRENT_FILE + "\n")]
