"""The engine's view of one request. Plain Python: the scheduler and block bookkeeping use it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from server.engine.types import SamplingParams

PLACEHOLDER = -1  # a sampled token whose value is still on the device


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt then output, growing as tokens are sampled
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and the request's stop ids
    max_total_tokens: int = 0  # min(prompt + max_tokens, max_model_len)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    num_cached_tokens: int = 0  # prompt tokens served from reused KV at first admission
    num_disk_cached_tokens: int = 0  # of those, the ones read from the prefix cache's disk tier
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    return_all_logits: bool = False  # score(): logits of every position, not only the last
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled tokens whose step has not resolved yet (PLACEHOLDER in token_ids)
    state_slot: int | None = None  # hybrid models: this sequence's live slot in the state pool
    grammar: Any = None  # structured outputs: the request's grammar.GrammarMatcher
    error: Any = None  # finish_reason "error": the InvalidRequestError that says why (a grammar that could not go on)
    reasoning: Any = None  # params.reasoning_budget: the request's reasoning_budget.ReasoningBudget

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def may_mask(self, index: int) -> bool:
        """Whether the token at output `index` may be sampled under a mask: a grammar, or a spent reasoning budget
        (known for sure once every earlier token is)."""
        return self.grammar is not None or (self.reasoning is not None and self.reasoning.may_force(index))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
