"""The disk tier under the in-memory prefix cache: which KV blocks and hybrid state snapshots have a file, the byte
budget and its LRU order, and the copies to plan between two steps. Plain Python, no torch: the tensors are
`PrefixIO`'s (server.engine.prefix_store), which this module drives through a small interface.

A file is keyed by the chained hash of its block (`block_allocator.chain_hash`), the same key as in memory, and
lives under a directory named by the model's fingerprint, so another model or build never looks at it. Blocks and
snapshots are written when memory evicts them (and at shutdown, `DiskTier.save_all`), read back when a later
prompt's prefix hashes to them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

KV, STATE = "kv", "state"  # the two kinds of file: one KV block of every layer, one hybrid state snapshot
SUFFIX = ".safetensors"
STALE_TMP_S = 3600.0


class PrefixIO(Protocol):
    """The tensor side of the disk tier (server.engine.prefix_store.PrefixStore)."""

    def read(self, kind: str, key: bytes, path: Path) -> Any | None:
        """The validated contents of a file (opaque here), or None when it is missing, corrupt or foreign."""

    def read_many(self, kind: str, items: Sequence[tuple[bytes, Path]]) -> list[Any]:
        """`read` of each in order, in parallel; the leading run of files that read back whole."""

    def save(self, kind: str, items: Sequence[tuple[int, bytes, Path]]) -> list[bool]:
        """Queue writes of slots (block ids or snapshot slots) to files; per item whether it was taken (a full
        queue drops it: the engine loop never waits for the disk). `DiskTier.written` is called from the writer
        thread for each file taken."""

    def load(self, kind: str, items: Sequence[tuple[int, Any]]) -> None:
        """Queue copies of read contents into slots, before the next step's forward."""

    def drain(self) -> None:
        """Wait for the writes queued so far to finish."""


class DiskIndex:
    """Files of one model's directory: their sizes, least recently used first, within a byte budget. The writer
    thread adds files while the engine thread reads: what reads or changes the order takes the lock."""

    def __init__(self, root: Path, budget_bytes: int):
        self.root, self.budget_bytes = root, budget_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._bytes = 0  # the sum of _files' sizes
        root.mkdir(parents=True, exist_ok=True)
        for _, entry, size in sorted(_scan(root)):  # a file's mtime is its last use (`touch`)
            self._files[entry] = size
            self._bytes += size
        self._trim()

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def path(self, kind: str, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{kind}-{name}{SUFFIX}"

    def has(self, kind: str, key: bytes) -> bool:
        with self._lock:
            return (kind, key) in self._files

    def touch(self, kind: str, key: bytes) -> None:
        """A file was used: it is evicted last (the mtime carries the order over a restart)."""
        with self._lock:
            if (kind, key) in self._files:
                self._files.move_to_end((kind, key))
        try:
            os.utime(self.path(kind, key))
        except OSError:
            pass

    def add(self, kind: str, key: bytes, size: int) -> None:
        """A file was written: it counts against the budget, whose oldest files go until it fits."""
        with self._lock:
            self._bytes += size - self._files.get((kind, key), 0)
            self._files[(kind, key)] = size
            self._files.move_to_end((kind, key))
            self._trim()

    def discard(self, kind: str, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._files.pop((kind, key), 0)
        self.path(kind, key).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self._bytes > self.budget_bytes and self._files:
            (kind, key), size = self._files.popitem(last=False)
            self._bytes -= size
            self.path(kind, key).unlink(missing_ok=True)


def _scan(root: Path) -> list[tuple[float, tuple[str, bytes], int]]:
    """(mtime, entry, size) of the cache files under `root`; removes temporary files a killed writer left."""
    found = []
    for path in root.glob("*/*"):
        try:
            stat = path.stat()
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                if time.time() - stat.st_mtime > STALE_TMP_S:  # younger ones may be another process's writes
                    path.unlink()
            elif (entry := _parse_name(path.name)) is not None:
                found.append((stat.st_mtime, entry, stat.st_size))
        except OSError:
            continue  # removed meanwhile (another process on this directory)
    return found


def _parse_name(name: str) -> tuple[str, bytes] | None:
    kind, _, rest = name.removesuffix(SUFFIX).partition("-")
    try:
        return (kind, bytes.fromhex(rest)) if kind in (KV, STATE) and rest else None
    except ValueError:
        return None


@dataclass
class TierCounts:
    """What the disk tier did since start (the engine's stats)."""

    writes_dropped: int = 0  # evicted blocks or snapshots not written: the write queue was full


class DiskTier:
    """The KV manager's view of the disk tier. Between `schedule()` and the next forward the engine calls `apply()`:
    the copies out of evicted slots are queued first, then the copies into slots loaded from disk, so a slot both
    evicted and refilled in one schedule is read before it is overwritten."""

    def __init__(self, index: DiskIndex, io: PrefixIO):
        self.index, self.io = index, io
        self.counts = TierCounts()
        self._saves: dict[str, list[tuple[int, bytes]]] = {KV: [], STATE: []}
        self._loads: dict[str, dict[int, Any]] = {KV: {}, STATE: {}}
        self._queued: set[tuple[str, bytes]] = set()  # taken by the writer, not yet on disk
        self._lock = threading.Lock()

    def has(self, kind: str, key: bytes) -> bool:
        return self.index.has(kind, key)

    def evicted(self, kind: str, slot: int, key: bytes) -> None:
        """Memory gives `slot` (holding `key`) new content: save it unless the disk has it already. A slot whose
        load from disk is still planned holds nothing yet, and its file exists: the load is dropped."""
        if self._loads[kind].pop(slot, None) is not None:
            return
        if self.index.has(kind, key):
            self.index.touch(kind, key)
            return
        with self._lock:
            if (kind, key) in self._queued:
                return
        self._saves[kind].append((slot, key))

    def read_blocks(self, keys: Sequence[bytes]) -> list[Any]:
        """The contents of KV files `keys` in order, up to the first that is missing or bad."""
        payloads = self.io.read_many(KV, [(key, self.index.path(KV, key)) for key in keys])
        for key in keys[: len(payloads)]:
            self.index.touch(KV, key)
        if len(payloads) < len(keys):
            self.index.discard(KV, keys[len(payloads)])  # missing or bad: never tried again
        return payloads

    def read_state(self, key: bytes) -> Any | None:
        payload = self.io.read(STATE, key, self.index.path(STATE, key))
        if payload is None:
            self.index.discard(STATE, key)
        else:
            self.index.touch(STATE, key)
        return payload

    def plan_load(self, kind: str, slot: int, payload: Any) -> None:
        self._loads[kind][slot] = payload

    def apply(self) -> None:
        """Queue the planned copies: out of evicted slots, then into loaded ones (before the next forward)."""
        for kind in (KV, STATE):
            saves, self._saves[kind] = self._saves[kind], []
            if saves:
                self._save(kind, saves)
        for kind in (KV, STATE):
            loads, self._loads[kind] = self._loads[kind], {}
            if loads:
                self.io.load(kind, list(loads.items()))

    def _save(self, kind: str, saves: list[tuple[int, bytes]], count_drops: bool = True) -> int:
        """Queue the writes the writer takes now; -> how many it dropped."""
        unique: dict[bytes, int] = {}
        with self._lock:
            for slot, key in saves:
                if (kind, key) not in self._queued:
                    unique.setdefault(key, slot)
            self._queued.update((kind, key) for key in unique)
        taken = self.io.save(kind, [(slot, key, self.index.path(kind, key)) for key, slot in unique.items()])
        dropped = [key for key, ok in zip(unique, taken, strict=True) if not ok]
        with self._lock:
            self._queued.difference_update((kind, key) for key in dropped)
        if count_drops:
            self.counts.writes_dropped += len(dropped)
        return len(dropped)

    def written(self, kind: str, key: bytes, size: int | None) -> None:
        """From the writer thread: the file of `key` is complete (`size` bytes), or failed (None)."""
        with self._lock:
            self._queued.discard((kind, key))
        if size is not None:
            self.index.add(kind, key, size)

    def save_all(self, blocks: Iterable[tuple[int, bytes]], snapshots: Iterable[tuple[int, bytes]]) -> bool:
        """Queue writes of what memory holds and the disk lacks (between requests and at shutdown, so a restart
        finds it), as many as the writer takes now. -> True when none was left out (else call again later)."""
        self.apply()
        left_out = 0
        for kind, items in ((KV, blocks), (STATE, snapshots)):
            saves = [(slot, key) for slot, key in items if not self.index.has(kind, key)]
            left_out += self._save(kind, saves, count_drops=False)
        return not left_out
