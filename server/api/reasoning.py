"""Incremental `<think>...</think>` splitting of generated text into reasoning and content.

Reasoning starts when the output opens with `<think>` (after optional whitespace) or when the rendered prompt
already ends inside an open `<think>` (Qwen3 / DeepSeek-R1 style templates). Markup never reaches either side,
even when a tag is split across text deltas; whitespace around the reasoning is trimmed, as templates re-add it.
"""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.types import THINK_END, THINK_START


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (text to hold back)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the template ended the prompt inside `<think>`, so the output starts as reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_START)


class ReasoningParser:
    """feed(text) / finish() -> list of ("reasoning" | "content", text) pieces, in order."""

    def __init__(self, start_in_reasoning: bool = False):
        self._state = "reasoning" if start_in_reasoning else "detect"
        self._buf = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._reasoning_ws = ""  # trailing whitespace held until more reasoning follows

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._state == "detect" and self._buf:
            out.append(("content", self._buf))  # e.g. a lone "<thi": it was content after all
        elif self._state == "reasoning":
            self._emit_reasoning(self._buf, out)  # truncated thinking (max_tokens) is still reasoning
        self._buf = ""
        return out

    def _step(self, out: list[tuple[str, str]]) -> bool:
        """Consume what can be decided from the buffer; True when the state changed and more may follow."""
        buf = self._buf
        if self._state == "detect":
            stripped = buf.lstrip()
            if stripped.startswith(THINK_START):
                self._state, self._buf = "reasoning", stripped[len(THINK_START) :]
                return True
            if not stripped or THINK_START.startswith(stripped):
                return False  # not decided yet: hold
            self._state = "content"
            return True
        if self._state == "reasoning":
            end = buf.find(THINK_END)
            if end >= 0:
                self._emit_reasoning(buf[:end], out)
                self._reasoning_ws = ""
                self._state, self._buf = "after_reasoning", buf[end + len(THINK_END) :]
                return True
            keep = partial_marker_len(buf, (THINK_END,))
            self._emit_reasoning(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
            return False
        if self._state == "after_reasoning":
            stripped = buf.lstrip()
            self._buf = stripped
            if not stripped:
                return False
            self._state = "content"
            return True
        if buf:
            out.append(("content", buf))
        self._buf = ""
        return False

    def _emit_reasoning(self, text: str, out: list[tuple[str, str]]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_started = True
        text = self._reasoning_ws + text
        body = text.rstrip()
        self._reasoning_ws = text[len(body) :]
        if body:
            out.append(("reasoning", body))
