"""Per-sequence fixed-size state of hybrid models (short-conv and Gated DeltaNet layers), beside the paged KV.

`StateCache` holds, per state layer, tensors `[num_slots + 1, ...]` on the device (the last is scratch for the
padded rows of a compiled decode batch). Which slot each sequence uses, and which snapshot slot holds the state
at which block boundary, is `StateSlots`' bookkeeping (server.engine.state_slots). The copies run on the device
in the order restores, resets, saves, so a snapshot read and overwritten in the same step is read first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from server.engine.state_slots import StateSlots

StateSpec = list[tuple[tuple[int, ...], torch.dtype | None]]  # one state layer: (shape, dtype or None = model)


def state_pool(specs: list[StateSpec] | None, max_num_seqs: int, enable_prefix_caching: bool, block_size: int,
               dtype: torch.dtype, device: torch.device) -> tuple[StateCache | None, StateSlots | None]:
    """Hybrid models (`specs` given): one live slot per running sequence plus as many block-boundary snapshots
    (prefix reuse of a conversation's states) when prefix caching is on. -> (the state tensors, their slot
    bookkeeping); (None, None) for attention-only models."""
    if specs is None:
        return None, None
    slots = _slots(max_num_seqs, enable_prefix_caching, block_size)
    return StateCache(specs, slots.num_slots, dtype, device), slots


def state_pool_bytes(specs: list[StateSpec] | None, max_num_seqs: int, enable_prefix_caching: bool, block_size: int,
                     dtype: torch.dtype) -> int:
    """The bytes `state_pool` allocates for these arguments, without allocating them."""
    if specs is None:
        return 0
    num_rows = _slots(max_num_seqs, enable_prefix_caching, block_size).num_slots + 1  # StateCache's, scratch too
    return sum(math.prod(shape) * (tdtype or dtype).itemsize * num_rows for spec in specs for shape, tdtype in spec)


def _slots(max_num_seqs: int, enable_prefix_caching: bool, block_size: int) -> StateSlots:
    return StateSlots(max_num_seqs, max_num_seqs if enable_prefix_caching else 0, block_size)


class StateCache:
    """Per state layer, a tuple of tensors `[num_slots + 1, *shape]` on the device (conv states in the model
    dtype, recurrent states as declared, fp32 for Gated DeltaNet). The extra last slot is scratch: the padded
    rows of a bucketed (compiled) decode batch read and write it."""

    def __init__(self, specs: list[StateSpec], num_slots: int, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.scratch_slot = num_slots
        self.layers = [
            tuple(torch.zeros(num_slots + 1, *shape, dtype=tdtype or dtype, device=device) for shape, tdtype in spec)
            for spec in specs
        ]

    def prepare(self, chunks, meta) -> None:
        """Before a step: the state copies (`apply_copies`), then point `meta` at the sequences' slots.
        `chunks` are the step's ScheduledChunks, in row order."""
        self.apply_copies(chunks)
        meta.state_slots = self._tensor([c.request.state_slot for c in chunks])
        meta.query_lens = self._tensor([c.num_tokens for c in chunks])
        meta.state_caches = self.layers

    def decode_slot_ids(self, chunks) -> list[int]:
        """The compiled decode step's state slots, one per row, once the snapshot copies are queued (padded
        rows take `scratch_slot`)."""
        self.apply_copies(chunks)
        return [c.request.state_slot for c in chunks]

    def apply_copies(self, chunks) -> None:
        """Restore snapshots, zero the slots of sequences starting at 0, save snapshots (in that order)."""
        restores = [(c.state_restore, c.request.state_slot) for c in chunks if c.state_restore is not None]
        resets = [c.request.state_slot for c in chunks if c.start == 0 and c.state_restore is None]
        saves = [(c.request.state_slot, c.state_save) for c in chunks if c.state_save is not None]
        if restores:
            self._copy(*zip(*restores, strict=True))
        if resets:
            index = self._tensor(resets)
            for tensors in self.layers:
                for t in tensors:
                    t.index_fill_(0, index, 0)
        if saves:
            self._copy(*zip(*saves, strict=True))

    def _copy(self, sources: Sequence[int], dests: Sequence[int]) -> None:
        src, dst = self._tensor(sources), self._tensor(dests)
        for tensors in self.layers:
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64).to(self.device, non_blocking=True)
