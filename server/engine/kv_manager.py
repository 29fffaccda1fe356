"""What each request holds of the KV cache: its blocks, the chained hashes of its full blocks (prefix reuse) and,
for hybrid models, its state slot and snapshots. Plain Python, no torch.

The scheduler decides who runs; it asks this manager for blocks and gives them back, and never does block
arithmetic itself. A request's `block_ids`, `block_hashes` and `state_slot` are written here only.
"""

from __future__ import annotations

from server.engine.block_allocator import BlockAllocator, chain_hash
from server.engine.request import Request
from server.engine.state_slots import StateSlots

NULL_BLOCK = 0  # reserved by the allocator: padded decode rows and warm-up runs read and write it


class KVManager:
    def __init__(self, allocator: BlockAllocator, state_slots: StateSlots | None = None):
        self.allocator = allocator
        self.state_slots = state_slots  # hybrid models: per-sequence state slots and snapshots

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def num_usable_blocks(self) -> int:
        return self.allocator.num_usable

    def match_prefix(self, request: Request) -> int:
        """Give a request without blocks the longest cached run of full blocks that prefixes its tokens (for a
        hybrid, only up to a block whose state snapshot exists). -> the number of tokens it need not compute."""
        if request.return_all_logits:
            return 0  # scoring needs the logits of every position, so nothing may be skipped
        block_ids, hashes = self.allocator.match_prefix(request.token_ids)
        if self.state_slots is not None:
            keep = self.state_slots.match(request.request_id, hashes)
            self.allocator.free(block_ids[keep:])
            block_ids, hashes = block_ids[:keep], hashes[:keep]
        request.block_ids, request.block_hashes = block_ids, hashes
        return len(block_ids) * self.block_size

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Blocks for the request's first `num_tokens` tokens. False, and nothing taken, when too few are free."""
        needed = -(-num_tokens // self.block_size) - len(request.block_ids)
        if needed > self.allocator.num_free:
            return False
        request.block_ids.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def admit(self, request: Request) -> None:
        """The request enters the running set: a hybrid takes a live state slot (bounded by max_num_seqs)."""
        if self.state_slots is not None:
            request.state_slot = self.state_slots.admit()

    def free(self, request: Request) -> None:
        """The request finished or was preempted: its blocks and live state slot return at once (full blocks
        stay reusable by prefix until their block is taken again)."""
        if self.state_slots is not None:
            self.state_slots.release(request.request_id, request.state_slot)
            request.state_slot = None
        self.allocator.free(request.block_ids)
        request.block_ids, request.block_hashes = [], []

    def register_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks whose tokens are all computed and known, so later prompts can reuse them."""
        size = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens - request.num_pending_tokens) // size
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            block_hash = chain_hash(parent, request.token_ids[i * size : (i + 1) * size])
            request.block_hashes.append(block_hash)
            self.allocator.register_full_block(request.block_ids[i], block_hash)

    def plan_state_copies(self, request: Request, start: int) -> tuple[int | None, int | None]:
        """Hybrids: (snapshot to restore into the live slot, snapshot slot to save it into) before the step whose
        first position is `start`; (None, None) for attention-only models."""
        if self.state_slots is None:
            return None, None
        self.register_full_blocks(request)  # a block-boundary state snapshot is keyed by its hash
        return self.state_slots.plan(request.request_id, request.block_hashes, start)

    def publish_state(self, slot: int) -> None:
        """The step saving a snapshot into `slot` was launched: its state may be matched from now on."""
        self.state_slots.publish(slot)


class NullBlocks(KVManager):
    """The KV manager of warm-up runs that must not touch any real sequence: every block a request gets is the
    null block (block 0, which the allocator never hands out), every hybrid state the scratch slot, and nothing
    is cached or shared. So compiling can run beside serving, on the same caches."""

    def __init__(self, block_size: int, num_usable_blocks: int, scratch_state_slot: int | None):
        self._block_size, self._num_usable = block_size, num_usable_blocks
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = None

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return self._num_usable

    @property
    def num_used_blocks(self) -> int:
        return 0

    @property
    def num_usable_blocks(self) -> int:
        return self._num_usable

    def match_prefix(self, request: Request) -> int:
        request.block_ids, request.block_hashes = [], []
        return 0

    def allocate(self, request: Request, num_tokens: int) -> bool:
        request.block_ids.extend([NULL_BLOCK] * (-(-num_tokens // self.block_size) - len(request.block_ids)))
        return True

    def admit(self, request: Request) -> None:
        request.state_slot = self.scratch_state_slot

    def free(self, request: Request) -> None:
        request.block_ids, request.block_hashes, request.state_slot = [], [], None

    def register_full_blocks(self, request: Request) -> None:
        pass

    def plan_state_copies(self, request: Request, start: int) -> tuple[int | None, int | None]:
        return None, None
