"""Hybrid state-slot bookkeeping: live slots, snapshots keyed by block hashes, pins and LRU eviction. No torch."""

from __future__ import annotations

from server.engine.state_slots import StateSlots

H = [bytes([i]) * 16 for i in range(8)]  # stand-ins for the chained hashes of blocks 1..8


def save(slots: StateSlots, request_id: str, num_blocks: int, block_size: int = 4) -> int | None:
    """Plan the step that starts at the boundary after `num_blocks` blocks, then launch it: the saved slot."""
    restore, slot = slots.plan(request_id, H[:num_blocks], num_blocks * block_size)
    assert restore is None
    if slot is not None:
        slots.publish(slot)
    return slot


def test_live_slots_are_taken_at_admission_and_returned_on_release():
    slots = StateSlots(num_live=2, num_snapshots=0, block_size=4)
    first, second = slots.admit(), slots.admit()
    assert {first, second} == {0, 1} and slots.free_live == []
    slots.release("a", first)
    assert slots.admit() == first


def test_a_snapshot_is_matchable_only_once_published():
    slots = StateSlots(num_live=1, num_snapshots=2, block_size=4)
    _, slot = slots.plan("a", H[:2], 8)
    assert slot is not None and slots.match("b", H[:2]) == 0
    slots.publish(slot)
    assert slots.match("c", H[:3]) == 2


def test_match_returns_the_longest_prefix_that_ends_at_a_snapshot():
    slots = StateSlots(num_live=2, num_snapshots=2, block_size=4)
    at_1 = save(slots, "a", 1)
    slots.release("a", None)
    at_3 = save(slots, "b", 3)
    slots.release("b", None)
    assert at_1 != at_3
    assert slots.match("c", H[:5]) == 3 and slots.plan("c", H[:3], 12) == (at_3, None)
    assert slots.match("d", H[:2]) == 1 and slots.plan("d", H[:1], 4) == (at_1, None)
    assert slots.match("e", [H[5], H[6]]) == 0  # another prefix: no snapshot, compute from the start


def test_eviction_takes_the_least_recently_used_snapshot():
    slots = StateSlots(num_live=3, num_snapshots=2, block_size=4)
    old, new = save(slots, "a", 1), save(slots, "b", 2)
    slots.release("a", None)
    slots.release("b", None)
    assert slots.match("c", H[:1]) == 1  # `old` is used again (restored), so `new` is now the older one
    assert slots.plan("c", H[:1], 4) == (old, None)
    evicted = save(slots, "d", 5)
    assert evicted == new
    assert slots.match("e", H[:2]) == 1  # block 2's snapshot is gone, block 1's is still cached
    assert slots.match("f", H[:5]) == 5


def test_pinned_snapshots_are_not_evicted_until_released():
    slots = StateSlots(num_live=2, num_snapshots=1, block_size=4)
    cached = save(slots, "a", 2)
    slots.release("a", None)
    assert slots.match("b", H[:2]) == 2  # pinned until b's restore runs or b is released
    assert save(slots, "c", 4) is None  # the only snapshot slot is pinned: nothing is saved
    assert slots.match("d", H[:2]) == 2
    slots.release("b", None)  # one pin left (d's)
    assert save(slots, "c", 4) is None
    slots.release("d", None)  # no pins: evictable
    assert save(slots, "c", 4) == cached and slots.match("e", H[:2]) == 0


def test_a_running_sequence_rolls_one_snapshot_forward():
    slots = StateSlots(num_live=1, num_snapshots=2, block_size=4)
    first, second = save(slots, "a", 1), save(slots, "a", 2)
    assert first == second and slots.free_snapshots  # one slot per sequence, the other stays free
    assert slots.match("b", H[:1]) == 0 and slots.match("c", H[:2]) == 2
