"""The packed decode row: what pack_row writes, unpack reads back, and what padding rows point at."""

from __future__ import annotations

import torch

from server.compile.decode_graphs import NULL_BLOCK, DecodeRows


def test_rows_round_trip_with_and_without_a_state_slot():
    for rows, state_slot in ((DecodeRows(), None), (DecodeRows(scratch_state_slot=9), 3)):
        packed = torch.tensor([rows.pack_row(11, 21, 37, -1, state_slot, [5, 6], 4),
                               rows.pack_row(12, 5, 22, 0, state_slot, [7], 4),
                               rows.padding_row(4)])
        assert rows.num_blocks(packed) == 4
        fields = rows.unpack(packed)
        assert fields.input_ids.tolist() == [11, 12, 0] and fields.positions.tolist() == [21, 5, 0]
        assert fields.slot_mapping.tolist() == [37, 22, 0] and fields.feed_rows.tolist() == [-1, 0, -1]
        assert fields.block_tables.tolist() == [[5, 6, NULL_BLOCK, NULL_BLOCK], [7] + [NULL_BLOCK] * 3,
                                                [NULL_BLOCK] * 4]
        if state_slot is None:
            assert fields.state_slots is None and packed.shape == (3, 4 + 4)
        else:  # padded rows read and write the scratch state
            assert fields.state_slots.tolist() == [3, 3, 9] and packed.shape == (3, 5 + 4)
