"""The disk tier's bookkeeping without a device: the byte budget and its LRU order (also over a restart), and the
order and dedup of the copies planned between two steps."""

from __future__ import annotations

import os
import time

from server.engine.block_allocator import BlockAllocator
from server.engine.kv_manager import KVManager
from server.engine.prefix_disk import KV, DiskIndex, DiskTier
from server.engine.request import Request
from server.engine.types import SamplingParams


def write(index: DiskIndex, key: bytes, size: int, mtime: float) -> None:
    path = index.path(KV, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    index.add(KV, key, size)


def test_budget_evicts_least_recently_used_and_restart_keeps_the_order(tmp_path):
    index = DiskIndex(tmp_path, budget_bytes=300)
    now = time.time()
    for i in range(3):
        write(index, bytes([i]), 100, mtime=now - 100 + i)
    index.touch(KV, bytes([0]))  # used again: now the newest
    write(index, bytes([3]), 100, mtime=now + 10)
    assert not index.has(KV, bytes([1])) and not index.path(KV, bytes([1])).exists()
    assert [k[0] for _, k in index._files] == [2, 0, 3] and index.total_bytes == 300
    stale, fresh = tmp_path / "00" / ".kv-00.safetensors.1.tmp", tmp_path / "00" / ".kv-01.safetensors.2.tmp"
    for path, age in ((stale, 7200), (fresh, 10)):  # temporary files of writers killed, or still writing
        path.write_bytes(b"x")
        os.utime(path, (now - age, now - age))
    smaller = DiskIndex(tmp_path, budget_bytes=200)  # a restart with a smaller budget trims the oldest by mtime
    assert not stale.exists() and fresh.exists()
    assert [k[0] for _, k in smaller._files] == [0, 3] and not index.path(KV, bytes([2])).exists()


class FakeIO:
    def __init__(self, capacity: int = 100):
        self.capacity, self.calls = capacity, []

    def read_many(self, kind, items):
        return [f"data-{key.hex()}" for key, _ in items]

    def save(self, kind, items):
        self.calls.append(("save", kind, [slot for slot, _, _ in items]))
        taken = [i < self.capacity for i in range(len(items))]
        self.capacity -= sum(taken)
        return taken

    def load(self, kind, items):
        self.calls.append(("load", kind, [slot for slot, _ in items]))


def test_evicted_blocks_are_saved_and_a_later_prefix_loads_them(tmp_path):
    io = FakeIO()
    tier = DiskTier(DiskIndex(tmp_path, 1 << 20), io)
    allocator = BlockAllocator(num_blocks=5, block_size=2, num_reserved=1)
    kv = KVManager(allocator)
    kv.attach_disk(tier)
    first = Request("a", list(range(1, 9)), 8, SamplingParams(), 0)
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.register_full_blocks(first)
    keys = list(first.block_hashes)
    kv.free(first)
    tier.written(KV, keys[0], 10)  # the first block's content is on disk already
    other = Request("b", [9] * 8, 8, SamplingParams(), 0)
    assert kv.match_prefix(other) == 0 and kv.allocate(other, 8)  # takes all four blocks: evicts the cached ones
    kv.apply_disk_copies()
    assert len(io.calls) == 1 and io.calls[0][:2] == ("save", KV) and len(io.calls[0][2]) == 3  # not the first
    for kind, key in list(tier._queued):
        tier.written(kind, key, 10)  # as the writer thread reports
    kv.free(other)
    io.calls.clear()
    again = Request("c", list(range(1, 10)), 9, SamplingParams(), 0)
    assert kv.match_prefix(again) == 8 and again.num_disk_cached_tokens == 8
    assert again.block_hashes == keys
    kv.apply_disk_copies()
    assert io.calls == [("load", KV, again.block_ids)]


def test_a_full_write_queue_drops_and_counts(tmp_path):
    io = FakeIO(capacity=1)
    tier = DiskTier(DiskIndex(tmp_path, 1 << 20), io)
    tier.evicted(KV, 1, b"a")
    tier.evicted(KV, 2, b"b")
    tier.evicted(KV, 3, b"a")  # the same content twice: written once
    tier.apply()
    assert io.calls == [("save", KV, [1, 2])] and tier.counts.writes_dropped == 1
    tier.plan_load(KV, 4, "payload")
    tier.evicted(KV, 4, b"c")  # evicted before its load ran: the load is dropped, nothing to save
    tier.apply()
    assert io.calls[1:] == []
