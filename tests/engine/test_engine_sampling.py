"""Engine-level sampling: seeds reproducible alone and in a batch, penalties, logprobs, stop handling."""

from __future__ import annotations

import pytest
import torch

from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.helpers import ENGINE_KW, random_ids


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint("qwen3_moe")[0]), **ENGINE_KW)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine):
    prompt = random_ids(12, 5)
    params = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate(prompt, params).token_ids
    assert engine.generate(prompt, params).token_ids == alone
    others = [random_ids(n, n) for n in (7, 30)]
    batch = engine.generate(
        [others[0], prompt, others[1]],
        SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, top_k=50, seed=1234, ignore_eos=True),
    )
    assert batch[1].token_ids == alone
    other_seed = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.3, seed=99, ignore_eos=True))
    assert other_seed.token_ids != alone  # 16 draws at T=1.3 over 256 tokens: equal only by a bug


def test_logprobs_are_log_softmax_of_the_model_logits(engine):
    prompt = random_ids(10, 8)
    out = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=4, ignore_eos=True))
    logits = engine.score(prompt + out.token_ids[:2])
    for i, entry in enumerate(out.logprobs):
        ref = torch.log_softmax(logits[len(prompt) - 1 + i], -1)
        assert entry.token_id == out.token_ids[i] == int(ref.argmax())
        assert abs(entry.logprob - ref[entry.token_id].item()) < 1e-4
        assert [t.token_id for t in entry.top] == ref.topk(4).indices.tolist()


def test_logit_bias_forces_a_token_and_stop_ids_end_generation(engine):
    prompt = random_ids(9, 9)
    out = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0}, ignore_eos=True))
    assert out.token_ids == [42] * 5
    out = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0}, stop_token_ids=[42]))
    assert out.token_ids == [42] and out.finish_reason == "stop"


def test_repetition_penalty_changes_greedy_output_consistently(engine):
    prompt = random_ids(15, 10)
    plain = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).token_ids
    penal = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, repetition_penalty=5.0,
                                                   frequency_penalty=2.0, ignore_eos=True)).token_ids
    assert penal != plain
    # With a strong penalty no generated token repeats an earlier output token.
    assert len(set(penal)) == len(penal)


def test_async_engine_streams_rejects_duplicate_ids_and_keeps_serving(engine):
    import asyncio

    from server.engine.async_engine import AsyncEngine
    from server.engine.types import InvalidRequestError

    async def main():
        served = AsyncEngine(engine)
        await served.start()
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            first = served.submit(random_ids(8, 1), params, request_id="same")
            with pytest.raises(InvalidRequestError, match="already in use"):
                served.submit(random_ids(8, 2), params, request_id="same")
            tokens = [t for d in [d async for d in first] for t in d.token_ids]
            alone = [t for d in [d async for d in served.stream(random_ids(8, 3), params)] for t in d.token_ids]
            return tokens, alone
        finally:
            await served.shutdown()

    tokens, alone = asyncio.run(main())
    assert tokens == engine.generate(random_ids(8, 1), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids
    assert len(alone) == 6
