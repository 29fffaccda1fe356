"""How many KV blocks an engine holds: what fits its budget, at most what its sequences can use, in steps coarse
enough that a restart with a little less (or more) free memory plans the same count (the count is in every
compiled graph's cache key); a hybrid's state pool comes out of the same budget."""

from __future__ import annotations

import random

import pytest
import torch

from server.config import EngineConfig
from server.engine.build import num_kv_blocks, plan_num_kv_blocks
from server.engine.device import free_memory_bytes
from server.engine.engine import Engine
from tests.helpers import ENGINE_KW


def test_a_budget_limited_count_loses_at_most_a_64th_and_small_differences_plan_the_same_count():
    rng = random.Random()
    for _ in range(2000):
        per_block = rng.randint(1, 1 << 20)
        fitting = rng.randint(2, 1 << 20)
        count = num_kv_blocks(fitting * per_block + rng.randrange(per_block), per_block, 16, 1 << 30, 1)
        assert fitting - fitting / 64 <= count <= fitting and count >= 2
    per_block = 786_432  # 48 layers of 4 KV heads of 128 dims, bf16, 16-token blocks
    counts = {num_kv_blocks((19_968 + extra) * per_block, per_block, 16, 1 << 30, 1) for extra in range(256)}
    assert counts == {19_968}  # 200 MB of free memory apart, one count


def test_the_count_is_exact_where_the_sequences_cap_it_and_a_budget_without_a_block_is_refused():
    assert num_kv_blocks(10**12, 1000, 16, 4096, 8) == 8 * 256
    assert num_kv_blocks(10**12, 1000, 16, 4097, 3) == 3 * 257
    with pytest.raises(ValueError, match="holds no KV block"):
        num_kv_blocks(1500, 1000, 16, 4096, 8)


def test_a_hybrids_state_pool_comes_out_of_the_kv_budget_it_was_planned_with(hybrid_checkpoint):
    path, _ = hybrid_checkpoint("qwen3_5_moe_text")
    kw = {**ENGINE_KW, "kv_cache_memory_bytes": None, "kv_cache_memory_fraction": 1e-4}  # of free memory
    budget = int(free_memory_bytes(torch.device("cpu")) * kw["kv_cache_memory_fraction"])
    engine = Engine.from_pretrained(str(path), **kw)
    state_bytes = sum(t.numel() * t.element_size() for layer in engine.state_cache.layers for t in layer)
    assert state_bytes > 0
    block_bytes = sum(layer[0].numel() * layer.element_size() for layer in engine.kv_cache.layers)
    expected = num_kv_blocks(budget - state_bytes, block_bytes, ENGINE_KW["block_size"], engine.max_model_len,
                             ENGINE_KW["max_num_seqs"])
    assert engine.kv_cache.num_blocks - 1 == expected < ENGINE_KW["max_num_seqs"] * engine.max_model_len // 4
    config = EngineConfig.from_flat(**kw)
    assert plan_num_kv_blocks(engine.model, config, engine.device, torch.float32, engine.max_model_len) == expected
