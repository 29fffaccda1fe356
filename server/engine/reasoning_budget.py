"""A request's reasoning budget (`SamplingParams.reasoning_budget`): where the reasoning section has run for that many
tokens without closing, the engine writes the end-of-thinking marker itself, one token per step, and the answer
follows. Plain Python, no torch.

The reasoning opens where the rendered prompt ends inside `<think>` (Qwen3.5 / DeepSeek-R1 style templates) or where
the output opens with it (Qwen3); it closes at `</think>`, whoever wrote it. The markers are followed as token ids (as
the tokenizer spells them), from the sampled ids the engine reads once per step; a forced token reaches the sampler
as a one-token mask (engine.grammar.only_token), so the decode step itself does nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.types import THINK_END, THINK_START

_LEADING_TOKENS = 2  # the output may open with a little whitespace before `<think>`


class ReasoningBudget:
    def __init__(self, budget: int, start_ids: Sequence[int], end_ids: Sequence[int], opened: bool):
        """`opened`: the prompt already ends inside the reasoning section."""
        self.budget = budget
        self._start, self._end = tuple(start_ids), tuple(end_ids)
        self._state = "thinking" if opened else "detect"
        self._think_from = 0  # output index of the reasoning's first token
        self._num_seen = 0
        self._tail: list[int] = []  # the last output tokens, as many as the longer marker has

    @classmethod
    def for_prompt(cls, budget: int, tokenizer, prompt_ids: Sequence[int]) -> ReasoningBudget:
        start, end = (tokenizer.encode(m, add_special_tokens=False) for m in (THINK_START, THINK_END))
        prompt_tail = tokenizer.decode(list(prompt_ids[-(len(start) + 4):]), skip_special_tokens=False)
        return cls(budget, start, end, opened=prompt_tail.rstrip().endswith(THINK_START))

    @property
    def thinking(self) -> bool:
        return self._state == "thinking"

    def advance(self, token_id: int) -> None:
        """Take the output's next token (sampled or forced)."""
        self._num_seen += 1
        self._tail = (self._tail + [token_id])[-max(len(self._start), len(self._end)):]
        if self._state == "detect":
            if self._ends_with(self._start):
                self._state, self._think_from = "thinking", self._num_seen
            elif self._num_seen >= len(self._start) + _LEADING_TOKENS:
                self._state = "off"
        elif self._state == "thinking" and self._ends_with(self._end):
            self._state = "done"

    def may_force(self, index: int) -> bool:
        """Whether the token at output `index` may be forced, from what is known so far (a superset of forced_token,
        which needs every earlier token)."""
        return self._state == "thinking" and index - self._think_from >= self.budget

    def forced_token(self, index: int) -> int | None:
        """The marker token written at output `index` (every token before it advanced), or None: sampled freely."""
        if not self.may_force(index):
            return None
        return self._end[self._matched_end_prefix()]

    def _matched_end_prefix(self) -> int:
        """How many leading tokens of the end marker the output already ends with (a forced marker in progress)."""
        for k in range(len(self._end) - 1, 0, -1):
            if self._ends_with(self._end[:k]):
                return k
        return 0

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        return len(self._tail) >= len(ids) and tuple(self._tail[-len(ids):]) == ids
