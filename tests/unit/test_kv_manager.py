"""The KV manager: blocks per request, prefix reuse by chained hashes, hybrid state slots. No torch."""

from __future__ import annotations

from server.engine.block_allocator import BlockAllocator
from server.engine.kv_manager import KVManager
from server.engine.request import Request
from server.engine.state_slots import StateSlots
from server.engine.types import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), len(tokens), SamplingParams(), seed=0, max_total_tokens=len(tokens) + 8)


def computed(kv: KVManager, request: Request) -> Request:
    """Blocks for the whole request, all of it computed, its full blocks published."""
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.register_full_blocks(request)
    return request


def test_allocate_takes_blocks_up_to_the_token_count():
    kv = KVManager(BlockAllocator(num_blocks=8, block_size=4, num_reserved=1))
    request = make_request("a", list(range(10)))
    assert kv.allocate(request, 10) and len(request.block_ids) == 3 and 0 not in request.block_ids
    assert kv.allocate(request, 12) and len(request.block_ids) == 3  # the third block has room
    assert kv.allocate(request, 13) and len(request.block_ids) == 4
    assert (kv.num_used_blocks, kv.num_free_blocks, kv.num_usable_blocks) == (4, 3, 7)


def test_running_out_of_blocks_takes_none():
    kv = KVManager(BlockAllocator(num_blocks=4, block_size=4, enable_prefix_caching=False))
    first, second = make_request("a", [1] * 8), make_request("b", [2] * 8)
    assert kv.allocate(first, 8)
    assert not kv.allocate(second, 12)  # 3 blocks wanted, 2 free
    assert second.block_ids == [] and kv.num_free_blocks == 2
    kv.free(first)
    assert first.block_ids == [] and kv.num_free_blocks == 4
    assert kv.allocate(second, 12)


def test_prefix_match_reuses_registered_full_blocks():
    kv = KVManager(BlockAllocator(num_blocks=16, block_size=4))
    first = computed(kv, make_request("a", list(range(10))))
    assert len(first.block_hashes) == 2  # two full blocks; the third holds 2 tokens
    full_blocks = first.block_ids[:2]
    kv.free(first)
    second = make_request("b", list(range(10)) + [77, 78])
    assert kv.match_prefix(second) == 8 and second.block_ids == full_blocks and len(second.block_hashes) == 2
    shifted = make_request("c", [5] + list(range(10)))
    assert kv.match_prefix(shifted) == 0  # the same tokens at another offset: hashes chain to the prefix
    scored = make_request("d", list(range(10)))
    scored.return_all_logits = True
    assert kv.match_prefix(scored) == 0 and scored.block_ids == []  # scoring computes every position


def test_a_full_prompt_hit_leaves_the_last_token_to_compute():
    kv = KVManager(BlockAllocator(num_blocks=16, block_size=4))
    kv.free(computed(kv, make_request("a", list(range(8)))))
    assert kv.match_prefix(make_request("b", list(range(8)))) == 4


def test_matched_blocks_are_shared_not_free():
    kv = KVManager(BlockAllocator(num_blocks=8, block_size=4))
    first = computed(kv, make_request("a", list(range(9))))
    second = make_request("b", list(range(9)))
    assert kv.match_prefix(second) == 8 and second.block_ids == first.block_ids[:2]
    kv.free(first)
    assert kv.num_used_blocks == 2  # still held by the second request
    kv.free(second)
    assert kv.num_used_blocks == 0


def test_hybrid_prefix_match_stops_at_the_last_state_snapshot():
    slots = StateSlots(num_live=2, num_snapshots=2, block_size=4)
    kv = KVManager(BlockAllocator(num_blocks=16, block_size=4), slots)
    first = make_request("a", list(range(13)))
    kv.admit(first)
    assert first.state_slot is not None
    assert kv.allocate(first, 13)
    first.num_computed_tokens = 4
    restore, snapshot = kv.plan_state_copies(first, 4)  # the step from position 4 saves the state after block 1
    assert restore is None and snapshot is not None
    kv.publish_state(snapshot)
    first.num_computed_tokens = 13
    kv.register_full_blocks(first)
    kv.free(first)
    assert first.state_slot is None and sorted(slots.free_live) == [0, 1]
    second = make_request("b", list(range(13)))
    assert kv.match_prefix(second) == 4  # 3 blocks cached, a state snapshot only after the first
    assert len(second.block_ids) == 1 and kv.num_used_blocks == 1  # the other two went back
    assert kv.plan_state_copies(second, 4) == (snapshot, None)  # restored before its first step


def test_attention_only_models_plan_no_state_copies():
    kv = KVManager(BlockAllocator(num_blocks=8, block_size=4))
    request = make_request("a", list(range(8)))
    kv.admit(request)
    assert request.state_slot is None and kv.plan_state_copies(request, 4) == (None, None)
