"""Continuous batching by token counts. Plain Python, no torch.

Each request has `num_computed_tokens` (KV written) and `num_tokens` (known). A step gives every running
request up to the tokens it lacks (1 while decoding, a chunk while prefilling) within a token budget,
running requests first so a long prompt delays running streams by at most one chunk. Admission is
bounded by free KV blocks and `max_num_seqs`; when blocks run out, the newest running request is
preempted (blocks freed, recomputed later), never failed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.block_allocator import BlockAllocator, chain_hash
from server.engine.request import PLACEHOLDER, Request, RequestStatus
from server.engine.types import FinishReason

if TYPE_CHECKING:
    from server.engine.state_cache import StateSlots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


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
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, state_slots: StateSlots | None = None):
        self.config = config
        self.allocator = allocator
        self.state_slots = state_slots  # hybrid models: per-sequence state slots and snapshots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_prefix_hit_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new):
                break
            self.waiting.popleft()
            if self.state_slots is not None:
                request.state_slot = self.state_slots.admit()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return out

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        end = request.num_computed_tokens + num_new
        chunk = ScheduledChunk(request, request.num_computed_tokens, num_new, sample=end == request.num_tokens)
        if self.state_slots is not None:
            self._register_full_blocks(request)  # a block-boundary state snapshot is keyed by its hash
            chunk.state_restore, chunk.state_save = self.state_slots.plan(
                request.request_id, request.block_hashes, chunk.start
            )
        return chunk

    def _match_prefix(self, request: Request) -> None:
        if request.return_all_logits:
            return  # scoring needs the logits of every position, so nothing may be skipped
        block_ids, hashes = self.allocator.match_prefix(request.token_ids)
        if self.state_slots is not None:  # hybrids reuse KV only up to a block whose state snapshot exists
            keep = self.state_slots.match(request.request_id, hashes)
            self.allocator.free(block_ids[keep:])
            block_ids, hashes = block_ids[:keep], hashes[:keep]
        request.block_ids, request.block_hashes = block_ids, hashes
        request.num_computed_tokens = len(block_ids) * self.allocator.block_size
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
            self.num_prefix_hit_tokens += request.num_computed_tokens

    def _reserve(self, request: Request, num_new: int) -> bool:
        needed = -(-(request.num_computed_tokens + num_new) // self.allocator.block_size) - len(request.block_ids)
        if needed > self.allocator.num_free:
            return False
        request.block_ids.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self._reserve(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._release_state(request)
        self.allocator.free(request.block_ids)
        request.block_ids, request.block_hashes = [], []
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
                self.state_slots.publish(chunk.state_save)  # hybrids: the snapshot copy is queued now
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
            self._register_full_blocks(request)
            updated.append((request, token_id))
            if token_id in request.stop_token_ids:
                self._finish_at(request, index, FinishReason.STOP.value)
            elif index + 1 >= request.max_total_tokens:
                self._finish_at(request, index, FinishReason.LENGTH.value)
        return updated

    def _finish_at(self, request: Request, index: int, reason: str) -> None:
        del request.token_ids[index + 1 :]  # drop a placeholder already queued for the next step
        self.finish(request, reason)

    def _register_full_blocks(self, request: Request) -> None:
        size = self.allocator.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens - request.num_pending_tokens) // size
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            block_hash = chain_hash(parent, request.token_ids[i * size : (i + 1) * size])
            request.block_hashes.append(block_hash)
            self.allocator.register_full_block(request.block_ids[i], block_hash)

    def finish(self, request: Request, reason: str) -> None:
        """End a request now (stop, length or abort) and free its blocks at once."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_state(request)
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def _release_state(self, request: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.release(request.request_id, request.state_slot)
            request.state_slot = None

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT.value)
        return request
