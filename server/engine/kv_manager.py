"""What each request holds of the KV cache: its blocks, the chained hashes of its full blocks (prefix reuse) and,
for hybrid models, its state slot and snapshots. Plain Python, no torch.

With a disk tier (server.engine.prefix_disk), a prefix hit goes on past the blocks in memory into blocks on disk:
those are read, given fresh blocks and published at once, their copies queued before the next forward. Blocks and
snapshots that memory evicts go to disk.

The scheduler decides who runs; it asks this manager for blocks and gives them back, and never does block
arithmetic itself. A request's `block_ids`, `block_hashes` and `state_slot` are written here only.
"""

from __future__ import annotations

from server.engine.block_allocator import BlockAllocator, chain_hash
from server.engine.prefix_disk import KV, STATE, DiskTier
from server.engine.request import Request
from server.engine.state_slots import StateSlots

NULL_BLOCK = 0  # reserved by the allocator: padded decode rows and warm-up runs read and write it


class KVManager:
    def __init__(self, allocator: BlockAllocator, state_slots: StateSlots | None = None):
        self.allocator = allocator
        self.state_slots = state_slots  # hybrid models: per-sequence state slots and snapshots
        self.disk: DiskTier | None = None  # the prefix cache's disk tier (attach_disk)

    def attach_disk(self, disk: DiskTier) -> None:
        """Put a disk tier under the prefix cache: what memory evicts goes there, prefix hits go on into it."""
        self.disk = disk
        self.allocator.on_evict = lambda block, key: disk.evicted(KV, block, key)
        if self.state_slots is not None:
            self.state_slots.on_evict = lambda slot, key: disk.evicted(STATE, slot, key)

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
        """Give a request without blocks the longest cached run of full blocks that prefixes its tokens, from
        memory then disk (for a hybrid, only up to a block whose state snapshot exists). -> the number of tokens it
        need not compute; `request.num_disk_cached_tokens` of them came from disk."""
        request.num_disk_cached_tokens = 0
        if request.return_all_logits:
            return 0  # scoring needs the logits of every position, so nothing may be skipped
        block_ids, hashes = self.allocator.match_prefix(request.token_ids)
        num_in_memory = len(block_ids)
        if self.disk is not None:
            on_disk = self._disk_chain(request.token_ids, hashes)
            if self.state_slots is not None:  # read no block past the last state that can be restored
                on_disk = on_disk[: max(0, self._longest_state(hashes + on_disk) - num_in_memory)]
            self._load_blocks(on_disk, block_ids, hashes)
        if self.state_slots is not None:
            keep = self._match_state(request, hashes)
            self.allocator.free(block_ids[keep:])
            block_ids, hashes = block_ids[:keep], hashes[:keep]
        request.block_ids, request.block_hashes = block_ids, hashes
        request.num_disk_cached_tokens = max(0, len(block_ids) - num_in_memory) * self.block_size
        return len(block_ids) * self.block_size

    def _disk_chain(self, token_ids: list[int], hashes: list[bytes]) -> list[bytes]:
        """The hashes of the full blocks after `hashes` that the disk holds, up to the first it does not."""
        size, found = self.block_size, []
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), (len(token_ids) - 1) // size):  # at least one token is left to compute
            parent = chain_hash(parent, token_ids[i * size : (i + 1) * size])
            if not self.disk.has(KV, parent):
                break
            found.append(parent)
        return found

    def _load_blocks(self, keys: list[bytes], block_ids: list[int], hashes: list[bytes]) -> None:
        """Read the KV files of `keys` (as many as read back whole and fit the free blocks) into fresh blocks,
        appended to `block_ids` / `hashes`, published now: their copies run before the next forward."""
        for key, payload in zip(keys, self.disk.read_blocks(keys[: self.allocator.num_free]), strict=False):
            block_id = self.allocator.allocate()
            self.allocator.register_full_block(block_id, key)
            self.disk.plan_load(KV, block_id, payload)
            block_ids.append(block_id)
            hashes.append(key)

    def _longest_state(self, hashes: list[bytes]) -> int:
        return max(self.state_slots.longest(hashes), self._longest_state_on_disk(hashes))

    def _longest_state_on_disk(self, hashes: list[bytes]) -> int:
        return next((n for n in range(len(hashes), 0, -1) if self.disk.has(STATE, hashes[n - 1])), 0)

    def _match_state(self, request: Request, hashes: list[bytes]) -> int:
        """Hybrids: how many leading blocks of `hashes` may be used, ending where a state snapshot exists in
        memory or (read now, copied before the next step) on disk; that snapshot is restored first."""
        slots = self.state_slots
        if self.disk is not None:
            on_disk = self._longest_state_on_disk(hashes)
            if on_disk > slots.longest(hashes):
                payload = self.disk.read_state(hashes[on_disk - 1])
                slot = None if payload is None else slots.take_for_restore(request.request_id, hashes[on_disk - 1])
                if slot is not None:
                    self.disk.plan_load(STATE, slot, payload)
                    return on_disk
        return slots.match(request.request_id, hashes)

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
        keep = start == self.prompt_snapshot_position(request)
        return self.state_slots.plan(request.request_id, request.block_hashes, start, keep)

    def prompt_snapshot_position(self, request: Request) -> int | None:
        """Hybrids with snapshots: the prompt's last block boundary before its last token, where a prefill chunk
        ends so that the state there is saved (and kept) for the next turn; None otherwise. (At the prompt's end
        itself no step may start: a request of one output token has no decode step.)"""
        if self.state_slots is None or not self.state_slots.num_snapshots:
            return None
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size or None

    def publish_state(self, slot: int) -> None:
        """The step saving a snapshot into `slot` was launched: its state may be matched from now on."""
        self.state_slots.publish(slot)

    def apply_disk_copies(self) -> None:
        """Between `schedule()` and the next forward: queue the disk tier's copies out of evicted blocks and
        snapshots, then into those read from disk."""
        if self.disk is not None:
            self.disk.apply()

    def save_to_disk(self) -> bool:
        """Queue writes of every cached block and snapshot the disk lacks (at shutdown: a restart finds them), as
        many as the writer takes now. -> True when all were taken (DiskTier.save_all)."""
        if self.disk is None:
            return True
        snapshots = list(self.state_slots.hash_of_slot.items()) if self.state_slots is not None else []
        return self.disk.save_all([(b, h) for h, b in self.allocator.cached.items()], snapshots)


class NullBlocks(KVManager):
    """The KV manager of warm-up runs that must not touch any real sequence: every block a request gets is the
    null block (block 0, which the allocator never hands out), every hybrid state the scratch slot, and nothing
    is cached or shared. So compiling can run beside serving, on the same caches."""

    def __init__(self, block_size: int, num_usable_blocks: int, scratch_state_slot: int | None):
        self._block_size, self._num_usable = block_size, num_usable_blocks
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = self.disk = None

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
