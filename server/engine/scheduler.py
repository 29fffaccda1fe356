"""Continuous batching by token counts. Plain Python, no torch.

Each request has `num_computed_tokens` (KV written) and `num_tokens` (known). A step gives every running
request up to the tokens it lacks (1 while decoding, a chunk while prefilling) within a token budget,
running requests first so a long prompt delays running streams by at most one chunk. Admission is
bounded by free KV blocks and `max_num_seqs`; when blocks run out, the newest running request is
preempted (blocks freed, recomputed later), never failed. Blocks, prefix hashes and hybrid state slots are
the KVManager's: the scheduler asks it for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.config import SchedulerConfig
from server.engine.kv_manager import KVManager
from server.engine.request import PLACEHOLDER, Request, RequestStatus
from server.engine.state_slots import StateSlots
from server.engine.types import FinishReason


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first token computed in this step
    num_tokens: int
    sample: bool  # the chunk reaches the last known token: sample the next one
    state_restore: int | None = None  # hybrids: state snapshot slot copied into the live slot first
    state_save: int | None = None  # hybrids: snapshot slot the live state is copied to before the step


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_prefix_hit_tokens = 0  # prompt tokens served from reused KV, memory or disk
        self.num_prefix_disk_hit_tokens = 0  # of those, read from the disk tier
        self.num_prefix_miss_tokens = 0  # prompt tokens computed at first admission

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def state_slots(self) -> StateSlots | None:
        return self.kv.state_slots

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._limit(request, min(request.num_tokens - request.num_computed_tokens, budget))
            if num_new <= 0 or request.num_tokens >= request.max_total_tokens:
                i += 1  # its last token is sampled (in flight): it finishes when that step resolves
                continue
            if not self._reserve_or_preempt(request, num_new, out):
                continue  # `request` itself was preempted; the list shrank
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted with a token still in flight: recompute once it is known
            if not request.block_ids:
                self._match_prefix(request)
            num_new = self._limit(request, min(request.num_tokens - request.num_computed_tokens, budget))
            if not self.kv.allocate(request, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            self._count_reuse(request)
            self.kv.admit(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return out

    def _limit(self, request: Request, num_new: int) -> int:
        """Hybrids: a prefill chunk ends at the prompt's last block boundary, so its state snapshot is taken."""
        start, stop = request.num_computed_tokens, self.kv.prompt_snapshot_position(request)
        return stop - start if stop is not None and start < stop < start + num_new else num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        end = request.num_computed_tokens + num_new
        chunk = ScheduledChunk(request, request.num_computed_tokens, num_new, sample=end == request.num_tokens)
        chunk.state_restore, chunk.state_save = self.kv.plan_state_copies(request, chunk.start)
        return chunk

    def _match_prefix(self, request: Request) -> None:
        request.num_computed_tokens = self.kv.match_prefix(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens

    def _count_reuse(self, request: Request) -> None:
        """At first admission: the prompt's tokens served from memory, from disk, and computed."""
        if request.num_preemptions == 0:
            self.num_prefix_hit_tokens += request.num_cached_tokens
            self.num_prefix_disk_hit_tokens += request.num_disk_cached_tokens
            self.num_prefix_miss_tokens += request.num_prompt_tokens - request.num_cached_tokens

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(request, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def on_launched(self, out: SchedulerOutput) -> None:
        """The step is queued on the device: count its tokens as computed and give each sampling request a
        placeholder token, so the next step can be scheduled before this one's ids reach the host."""
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if chunk.state_save is not None:
                self.kv.publish_state(chunk.state_save)  # hybrids: the snapshot copy is queued now
            if chunk.sample and not request.return_all_logits:
                request.token_ids.append(PLACEHOLDER)
                request.num_pending_tokens += 1

    def on_resolved(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """The step's sampled ids reached the host: fill the placeholders, publish newly full blocks, finish
        requests that hit a stop id or their length. Returns (request, token) for each live request."""
        updated = []
        for chunk in out.chunks:
            request = chunk.request
            token_id = sampled.get(request.request_id)
            if token_id is None or not chunk.sample:
                continue
            index = chunk.start + chunk.num_tokens  # where this step's placeholder sits
            request.num_pending_tokens -= 1
            if request.is_finished:
                continue  # aborted or stopped while the step ran: the token is discarded
            request.token_ids[index] = token_id
            self.kv.register_full_blocks(request)
            updated.append((request, token_id))
            if token_id in request.stop_token_ids:
                self._finish_at(request, index, FinishReason.STOP.value)
            elif index + 1 >= request.max_total_tokens:
                self._finish_at(request, index, FinishReason.LENGTH.value)
        return updated

    def _finish_at(self, request: Request, index: int, reason: str) -> None:
        del request.token_ids[index + 1 :]  # drop a placeholder already queued for the next step
        self.finish(request, reason)

    def finish(self, request: Request, reason: str) -> None:
        """End a request now (stop, length or abort) and free its blocks at once."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT.value)
        return request
