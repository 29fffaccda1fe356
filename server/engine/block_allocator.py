"""KV block bookkeeping: free list, reference counts and prefix hashes. Plain Python, no torch.

A block holds `block_size` consecutive tokens of one sequence. A full block is identified by a chained
hash of (hash of the previous block, its token ids), so equal prefixes map to equal hashes. Freed blocks
that carry a hash stay reusable until their slot is needed for something else (LRU order).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence


def chain_hash(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """128-bit content hash of a block chained to its parent; collisions are negligible."""
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_reserved: int = 0):
        """Blocks `0 .. num_reserved-1` are never handed out (the decode graphs point padded rows at block 0)."""
        if num_blocks - num_reserved < 1:
            raise ValueError("the KV cache needs at least one block; raise the KV memory budget")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id of a full block with that content
        # Blocks with no owner, oldest first. Those with a hash are still reusable by prefix match.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_reserved, num_blocks))
        self.num_usable = num_blocks - num_reserved
        self.on_evict: Callable[[int, bytes], None] | None = None  # (block, hash) about to get new content

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocksError("no free KV blocks")
        block_id, _ = self.free_blocks.popitem(last=False)
        old_hash = self.block_hashes[block_id]
        if old_hash is not None and self.cached.get(old_hash) == block_id:
            del self.cached[old_hash]  # evict: the slot gets new content
            if self.on_evict is not None:
                self.on_evict(block_id, old_hash)
        self.block_hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_ids: Sequence[int]) -> None:
        # Free the tail first so that, under eviction, a prefix outlives its continuations.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks that prefix `token_ids`: (block ids, their hashes).
        The matched blocks are taken (ref counted). At least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return [], []
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = None
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            h = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
        return block_ids, hashes

    def register_full_block(self, block_id: int, block_hash: bytes) -> None:
        """Publish a block whose tokens are all computed so later prompts can reuse it."""
        if not self.enable_prefix_caching:
            return
        self.block_hashes[block_id] = block_hash
        self.cached.setdefault(block_hash, block_id)
