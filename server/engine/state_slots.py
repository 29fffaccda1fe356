"""Which state slot each sequence of a hybrid model uses (plain Python, no torch; the scheduler's side of
`StateCache`, which holds the tensors).

- live slots `[0, num_live)`: one per running sequence, taken at admission and returned when the sequence
  finishes, is aborted or preempted. A sequence that starts at position 0 gets its slot zeroed.
- snapshot slots after them: a copy of a sequence's state taken at the start of a step whose first position
  is a multiple of block_size, keyed by the chained hash of the last full block (Request.block_hashes), so
  the key names exactly the tokens the state has consumed. Each running sequence keeps one rolling snapshot
  (its latest block boundary); when it finishes the snapshot stays cached (LRU) for the next chat turn.
  The snapshot at the prompt's last full block (`keep`) does not roll: decode takes another slot, so the next
  turn, whose prompt extends this one but may re-render the reply (templates drop past reasoning), finds it.
  A snapshot's key is published only when the step carrying its copy is launched (`publish`).

A hybrid may only reuse prefix KV up to a block boundary whose state snapshot exists (`StateSlots.match`);
the snapshot is copied into its live slot before its first step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class StateSlots:
    """Slot bookkeeping for the KV manager. Requests carry their live slot in `state_slot`."""

    def __init__(self, num_live: int, num_snapshots: int, block_size: int):
        self.num_live, self.num_snapshots, self.block_size = num_live, num_snapshots, block_size
        self.free_live = list(range(num_live - 1, -1, -1))
        self.free_snapshots = list(range(num_live + num_snapshots - 1, num_live - 1, -1))
        self.slot_of_hash: dict[bytes, int] = {}
        self.hash_of_slot: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unowned, unpinned; oldest first
        self.owner_of: dict[int, str] = {}  # snapshot slot -> request id whose rolling snapshot it is
        self.owned: dict[str, int] = {}  # request id -> its rolling snapshot slot
        self.pins: dict[int, int] = {}  # snapshot slot -> restores not yet copied out
        self.restore: dict[str, int] = {}  # request id -> snapshot to copy into its live slot first
        self.unpublished: dict[int, bytes] = {}  # snapshot slot -> key, until its save is launched
        self.kept: set[int] = set()  # snapshot slots their owner does not roll forward (the prompt's end)
        self.on_evict: Callable[[int, bytes], None] | None = None  # (slot, key) of a cached snapshot overwritten

    @property
    def num_slots(self) -> int:
        return self.num_live + self.num_snapshots

    def match(self, request_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prefix hit may be used: the longest run ending at a block whose
        state snapshot exists (0: none, compute from the start). The snapshot is pinned until restored."""
        self._drop_restore(request_id)
        for num_blocks in range(len(block_hashes), 0, -1):
            slot = self.slot_of_hash.get(block_hashes[num_blocks - 1])
            if slot is not None:
                self.restore[request_id] = slot
                self.pins[slot] = self.pins.get(slot, 0) + 1
                self.evictable.pop(slot, None)
                return num_blocks
        return 0

    def longest(self, block_hashes: Sequence[bytes]) -> int:
        """`match`'s answer, without taking anything."""
        return next((n for n in range(len(block_hashes), 0, -1) if block_hashes[n - 1] in self.slot_of_hash), 0)

    def take_for_restore(self, request_id: str, key: bytes) -> int | None:
        """A snapshot slot for a state read from disk, published under `key` at once (its copy is queued before
        the next step) and pinned for the request's restore; None when every snapshot slot is owned or pinned."""
        self._drop_restore(request_id)
        slot = self._spare_slot()
        if slot is None:
            return None
        self.slot_of_hash[key], self.hash_of_slot[slot] = slot, key
        self.restore[request_id] = slot
        self.pins[slot] = self.pins.get(slot, 0) + 1
        return slot

    def admit(self) -> int:
        """A live slot for a sequence entering the running set (the scheduler bounds them by num_live)."""
        return self.free_live.pop()

    def plan(self, request_id: str, block_hashes: Sequence[bytes], start: int,
             keep: bool = False) -> tuple[int | None, int | None]:
        """(snapshot to restore, snapshot slot to save into) before the step whose first position is `start`;
        `keep`: the saved snapshot is not rolled forward by the sequence's later saves."""
        restore = self.restore.pop(request_id, None)
        if restore is not None:
            self._unpin(restore)
            return restore, None
        num_blocks = start // self.block_size
        if not self.num_snapshots or start == 0 or start % self.block_size or len(block_hashes) < num_blocks:
            return None, None  # not at a block boundary, or its hash is not known yet (token in flight)
        key = block_hashes[num_blocks - 1]
        if key in self.slot_of_hash:
            return None, None  # this state is cached already
        slot = self._take_snapshot_slot(request_id)
        if slot is not None:
            self.unpublished[slot] = key
            if keep:
                self.kept.add(slot)
        return None, slot

    def publish(self, slot: int) -> None:
        """The save into `slot` was launched: its key may be matched from now on. (A step dropped before
        launch, e.g. its request stopped meanwhile, never publishes: the slot would hold an older state.)"""
        key = self.unpublished.pop(slot, None)
        if key is not None and slot in self.owner_of:
            self.slot_of_hash[key], self.hash_of_slot[slot] = slot, key

    def release(self, request_id: str, live_slot: int | None) -> None:
        """The sequence finished, was aborted or preempted: its live slot returns, its snapshot stays cached."""
        if live_slot is not None:
            self.free_live.append(live_slot)
        self._drop_restore(request_id)
        slot = self.owned.pop(request_id, None)
        if slot is not None:
            del self.owner_of[slot]
            self._maybe_evictable(slot)

    def _take_snapshot_slot(self, request_id: str) -> int | None:
        slot = self.owned.get(request_id)
        if slot is not None:
            if not self.pins.get(slot) and slot not in self.kept:
                self._forget_key(slot)
                return slot  # roll this sequence's snapshot forward
            del self.owned[request_id], self.owner_of[slot]  # restored by someone, or kept: leave it cached
            self._maybe_evictable(slot)
        slot = self._spare_slot()
        if slot is not None:
            self.owned[request_id], self.owner_of[slot] = slot, request_id
        return slot

    def _spare_slot(self) -> int | None:
        """A free snapshot slot, else the least recently used cached one (its state evicted), else None."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if not self.evictable:
            return None
        slot, _ = self.evictable.popitem(last=False)
        key = self.hash_of_slot.get(slot)
        if key is not None and self.on_evict is not None:
            self.on_evict(slot, key)
        self._forget_key(slot)
        return slot

    def _forget_key(self, slot: int) -> None:
        self.kept.discard(slot)
        self.unpublished.pop(slot, None)
        key = self.hash_of_slot.pop(slot, None)
        if key is not None and self.slot_of_hash.get(key) == slot:
            del self.slot_of_hash[key]

    def _drop_restore(self, request_id: str) -> None:
        slot = self.restore.pop(request_id, None)
        if slot is not None:
            self._unpin(slot)

    def _unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]
            self._maybe_evictable(slot)

    def _maybe_evictable(self, slot: int) -> None:
        """An unowned, unpinned snapshot is evictable (LRU) if it holds a published state, else free."""
        if slot in self.owner_of or self.pins.get(slot):
            return
        if slot in self.hash_of_slot:
            self.evictable[slot] = None
            self.evictable.move_to_end(slot)
        else:
            self.unpublished.pop(slot, None)
            self.kept.discard(slot)
            self.free_snapshots.append(slot)
