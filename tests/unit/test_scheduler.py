"""Scheduler and KV block bookkeeping: plain Python, no device."""

from __future__ import annotations

import random

from server.engine.block_allocator import BlockAllocator
from server.engine.kv_manager import KVManager
from server.engine.request import Request
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.types import SamplingParams


def make_request(rid: str, num_prompt: int, max_tokens: int = 8, tokens=None) -> Request:
    tokens = list(tokens) if tokens is not None else [random.randrange(1000) for _ in range(num_prompt)]
    return Request(rid, tokens, len(tokens), SamplingParams(max_tokens=max_tokens), seed=0,
                   stop_token_ids=frozenset({-1}), max_total_tokens=len(tokens) + max_tokens)


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.sample}
    sched.on_launched(out)
    sched.on_resolved(out, sampled)
    return out


def test_long_prompt_is_chunked_and_running_streams_keep_decoding():
    alloc = BlockAllocator(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512), KVManager(alloc))
    sched.add(make_request("short", 5, max_tokens=50))
    run_step(sched)  # prefill of the short request
    sched.add(make_request("long", 100))
    for _ in range(6):
        out = run_step(sched)
        by_id = {c.request.request_id: c for c in out.chunks}
        assert by_id["short"].num_tokens == 1  # the stream advances every step
        assert out.num_tokens <= 16
        assert by_id["long"].num_tokens == 15  # the rest of the budget goes to the long prompt
    assert sched.requests["long"].num_computed_tokens == 90


def test_abort_frees_blocks_at_once():
    alloc = BlockAllocator(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    sched.add(make_request("a", 10))
    run_step(sched)
    assert alloc.num_used == 3
    sched.abort("a")
    assert alloc.num_used == 0 and not sched.has_work


def test_preemption_instead_of_failure_when_blocks_run_out():
    alloc = BlockAllocator(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    sched.add(make_request("a", 8, max_tokens=12))
    sched.add(make_request("b", 8, max_tokens=12))
    preempted = []
    finished = set()
    for _ in range(80):
        if not sched.has_work:
            break
        out = run_step(sched)
        preempted += out.preempted_ids
        finished |= {c.request.request_id for c in out.chunks if c.request.is_finished}
        assert alloc.num_used <= 6
    assert preempted, "two requests needing 10 blocks in a 6-block pool must preempt"
    assert finished == {"a", "b"} and alloc.num_used == 0


def test_prefix_blocks_are_shared_and_hashes_chain():
    alloc = BlockAllocator(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    prompt = list(range(10))
    sched.add(make_request("a", 0, tokens=prompt, max_tokens=1))
    run_step(sched)  # finishes after one token; its two full blocks stay cached
    assert not sched.has_work
    sched.add(make_request("b", 0, tokens=prompt + [99, 98], max_tokens=1))
    out = sched.schedule()
    assert out.chunks[0].start == 8 and out.chunks[0].request.num_cached_tokens == 8
    # Same tokens at another offset do not match: hashes are chained to the prefix.
    sched.on_launched(out)
    sched.on_resolved(out, {"b": 1})
    sched.add(make_request("c", 0, tokens=[5] + prompt, max_tokens=1))
    assert sched.schedule().chunks[0].start == 0


def test_full_prompt_hit_still_computes_the_last_token():
    alloc = BlockAllocator(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    prompt = list(range(8))
    sched.add(make_request("a", 0, tokens=prompt, max_tokens=1))
    run_step(sched)
    sched.add(make_request("b", 0, tokens=prompt, max_tokens=1))
    chunk = sched.schedule().chunks[0]
    assert chunk.start == 4 and chunk.num_tokens == 4 and chunk.sample


def test_eviction_reuses_freed_cached_blocks_lru():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    ids = [alloc.allocate() for _ in range(4)]
    for i, block_id in enumerate(ids):
        alloc.register_full_block(block_id, bytes([i]) * 16)
    alloc.free(ids)
    assert alloc.num_free == 4
    new = alloc.allocate()  # evicts the least recently freed (the tail was freed first)
    assert new == ids[-1] and alloc.block_hashes[new] is None
    assert bytes([3]) * 16 not in alloc.cached and bytes([0]) * 16 in alloc.cached


def test_pipelined_steps_fill_placeholders_and_drop_the_token_after_a_stop():
    """Step N+1 is scheduled before step N's token is known; a stop at N discards N+1's token."""
    alloc = BlockAllocator(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    request = make_request("a", 6, max_tokens=10)
    request.stop_token_ids = frozenset({5})
    sched.add(request)
    out1 = sched.schedule()
    sched.on_launched(out1)
    assert request.token_ids[-1] == -1 and request.num_pending_tokens == 1
    out2 = sched.schedule()  # scheduled with the placeholder as input
    assert out2.chunks[0].start == 6 and out2.chunks[0].num_tokens == 1
    sched.on_launched(out2)
    assert sched.on_resolved(out1, {"a": 9}) == [(request, 9)]
    assert request.token_ids[6] == 9 and request.token_ids[7] == -1
    out3 = sched.schedule()
    sched.on_launched(out3)
    sched.on_resolved(out2, {"a": 5})  # a stop id: finish now, the token of out3 is discarded
    assert request.is_finished and request.finish_reason == "stop"
    assert request.output_token_ids == [9, 5] and alloc.num_used == 0
    assert sched.on_resolved(out3, {"a": 1}) == []


def test_last_allowed_token_in_flight_is_not_scheduled_again():
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, 512), KVManager(alloc))
    request = make_request("a", 5, max_tokens=1)
    sched.add(request)
    out = sched.schedule()
    sched.on_launched(out)
    assert sched.schedule().chunks == []
    sched.on_resolved(out, {"a": 3})
    assert request.finish_reason == "length" and request.output_token_ids == [3]
