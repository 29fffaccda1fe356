"""Parity with transformers on tiny random-weight checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from server.engine.types import SamplingParams
from tests.helpers import hf_greedy, make_engine, random_ids

ARCHS = ["llama", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_over_several_chunks(arch, tiny_checkpoint):
    path, hf_model = tiny_checkpoint(arch)
    engine = make_engine(path)
    ids = random_ids(53, seed=hash(arch) % 1000)  # 4 chunks of 16 tokens
    ours = engine.score(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (53, 256)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, tiny_checkpoint):
    path, hf_model = tiny_checkpoint(arch)
    engine = make_engine(path)
    ids = random_ids(21, seed=7)
    out = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf_model, ids, 24)
    assert out.finish_reason == "length" and out.completion_tokens == 24 and out.prompt_tokens == 21


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_batch_of_different_lengths_gives_each_single_result(arch, tiny_checkpoint):
    path, _ = tiny_checkpoint(arch)
    engine = make_engine(path, enable_prefix_caching=False)
    prompts = [random_ids(n, seed=n) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = engine.generate(prompts, params)
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.token_ids == engine.generate(prompt, params).token_ids


def test_prefix_reuse_matches_cold_run(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    warm = make_engine(path)
    cold = make_engine(path, enable_prefix_caching=False)
    system = random_ids(30, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = warm.generate(system + random_ids(5, seed=12), params)
    assert first.cached_tokens == 0
    follow = system + random_ids(9, seed=13)
    reused = warm.generate(follow, params)
    assert reused.cached_tokens == 28  # 7 full blocks of 4 shared with the first prompt
    assert reused.token_ids == cold.generate(follow, params).token_ids
    assert warm.stats().prefix_cache_hit_tokens == 28
