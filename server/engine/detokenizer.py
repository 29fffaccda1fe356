"""Streaming text out of token ids: an incremental detokenizer that never emits half a UTF-8 character,
and a stop-string matcher that never emits the start of a stop string before it knows it is not one.

The detokenizer decodes a short window of ids with two offsets, as vLLM does: `prefix_offset..read_offset`
is text already emitted (decoded again only as context, so a decoder that treats the first token of a
string specially treats it the same way both times), `read_offset..` is new. Each call costs a decode of
a few tokens, whatever the length of the output.
"""

from __future__ import annotations

from server.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context before the first output token (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most 4 byte tokens; unread tokens that still end in U+FFFD
# at every cut after this many hold invalid bytes, not an unfinished character: emit them, never hold forever.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turn a growing list of output ids into text deltas.

    With `prompt_token_ids=None` the concatenation of every `add()` and the final `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens)`. With prompt ids, the last few prompt tokens are
    decoded as context, which only changes the result for decoders that strip a leading space at the start
    of a string (SentencePiece-style): there the first output word keeps its space, as it should when the
    text continues the prompt.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = self._prompt_context(list(prompt_token_ids or []))
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last tokens, shortened until they decode to whole characters, so a prompt that
        ends inside a character does not shift the first delta."""
        context = prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = context[1:]
        return context

    def add(self, token_ids: list[int]) -> str:
        """Append ids; return the text they complete (possibly ""). Never ends inside a UTF-8 character."""
        self.token_ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the output: release whatever was held back, broken characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        end = len(self.token_ids)
        new_text = self._decode(self.token_ids[self.prefix_offset : end])
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            end, new_text = self._last_clean_cut()
            if end is None:
                return ""  # the unread tokens end inside a character: wait for the rest of its bytes
        self.prefix_offset = self.read_offset
        self.read_offset = end
        return new_text[len(prefix_text) :]

    def _last_clean_cut(self) -> tuple[int | None, str]:
        """The longest run of unread tokens whose text does not end inside a character, so the text before
        a character split across tokens streams now and only that character waits. After MAX_HELD_TOKENS
        unread tokens with no clean cut, the bytes are invalid rather than unfinished: emit them all."""
        num_ids = len(self.token_ids)
        for end in range(num_ids - 1, max(self.read_offset, num_ids - MAX_HELD_TOKENS), -1):
            text = self._decode(self.token_ids[self.prefix_offset : end])
            if not text.endswith(REPLACEMENT_CHAR):
                return end, text
        if num_ids - self.read_offset >= MAX_HELD_TOKENS:
            return num_ids, self._decode(self.token_ids[self.prefix_offset :])
        return None, ""


class StopStringMatcher:
    """Cut streamed text at the first stop string.

    `push` emits text only once it cannot be the start of a stop string. Generation stops at the first
    point where any stop string is complete; if several complete at that same character, the one that
    starts earliest (the longest) is the match.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        self.stop = [s for s in dict.fromkeys(stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_hold = max((len(s) for s in self.stop), default=1) - 1
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buffer = self.held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop_str = match
            self.stopped, self.matched, self.held = True, stop_str, ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            return buffer[:end], True
        hold = self._partial_suffix_len(buffer)
        self.held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At a finish that is not a stop string (length, EOS): release the held-back text."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # For one stop string its first occurrence is also the one that ends first.
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = buffer.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of some stop string."""
        for size in range(min(self.max_hold, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0
