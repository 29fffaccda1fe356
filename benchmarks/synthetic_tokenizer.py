"""A byte-level BPE tokenizer of a chosen vocabulary size, for benchmarks that need a real vocabulary's size
but cannot download the checkpoint's tokenizer (the structured-output mask's cost grows with the vocabulary).

Tokens grow the way BPE vocabularies do: from the 256 byte symbols, each new token merges two earlier ones, mostly
letters, with a leading-space marker on about half (as in GPT-2/Llama-3 vocabularies), up to 16 characters. Every
merge's parts exist before it, so the file is a valid BPE model that `tokenizers` and llguidance read.

    python3 benchmarks/synthetic_tokenizer.py OUT_DIR --vocab-size 128256
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

MAX_TOKEN_CHARS = 16
MAX_PIECE_CHARS = 4  # right-hand parts stay short, as suffixes do
EOS_TOKEN = "<|eot|>"


def _byte_symbols() -> list[str]:
    # GPT-2's printable stand-in for every byte: the alphabet byte-level BPE vocabularies are written in.
    return list(pre_tokenizers.ByteLevel.alphabet())


def _vocab_and_merges(num_tokens: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    rng = random.Random(seed)
    symbols = sorted(_byte_symbols())
    vocab = {s: i for i, s in enumerate(symbols)}
    letters = [s for s in symbols if s.isascii() and s.isalpha()]
    pieces = list(letters)  # the right-hand parts: word pieces without a space marker
    heads = list(letters) + ["Ġ"]  # the left-hand parts: word starts (with "Ġ", a leading space) and pieces
    merges: list[tuple[str, str]] = []
    while len(vocab) < num_tokens:
        # Early (short) tokens are drawn more often, so most tokens are short, as in real vocabularies.
        left, right = heads[int(len(heads) * rng.random() ** 3)], rng.choice(pieces)
        token = left + right
        if len(token) > MAX_TOKEN_CHARS or token in vocab:
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        if len(token) < MAX_TOKEN_CHARS - 1:  # only tokens that can still grow are drawn again
            heads.append(token)
        if len(token) <= MAX_PIECE_CHARS and not token.startswith("Ġ"):
            pieces.append(token)
    return vocab, merges


def write_synthetic_tokenizer(out_dir: str | Path, vocab_size: int, seed: int = 0) -> Path:
    """Writes tokenizer.json and config.json (the EOS id) for `vocab_size` ids, the last one EOS; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = _vocab_and_merges(vocab_size - 1, seed)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "config.json").write_text(json.dumps({"eos_token_id": tokenizer.token_to_id(EOS_TOKEN)}))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_synthetic_tokenizer(args.out_dir, args.vocab_size, args.seed)


if __name__ == "__main__":
    main()
