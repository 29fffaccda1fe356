"""The batched sampler against its per-row twin, independent formulas and the target distribution."""

from __future__ import annotations

import random

import pytest
import torch

from server.kernels.sampling import (
    SamplingRow,
    build_sampling_batch,
    chunked_cumsum,
    exponential_noise,
    is_plain_greedy,
    sample,
    sample_reference,
    two_stage_argmax,
)
from tests.kernels.sync_guard import assert_no_host_sync

VOCAB = 300


def _random_row(rng: random.Random) -> SamplingRow:
    return SamplingRow(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 5, 40, VOCAB + 10]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.5, -0.4]),
        frequency_penalty=rng.choice([0.0, 0.25]),
        logit_bias=rng.choice([None, {3: 4.0, 17: -100.0, VOCAB + 5: 1.0}]),
        seed=rng.randrange(-(2**40), 2**63),
        step=rng.randrange(0, 500),
        prompt_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))],
        output_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))],
        num_logprobs=rng.choice([None, 0, 2, 5]),
    )


@pytest.mark.parametrize("trial", range(6))
def test_sample_matches_per_row_reference(trial):
    rng = random.Random(trial)
    rows = [_random_row(rng) for _ in range(7)]
    batch = build_sampling_batch(rows, VOCAB, "cpu")
    logits = torch.randn(len(rows), VOCAB) * 3
    fast, ref = sample(logits, batch), sample_reference(logits, batch)
    assert fast.token_ids.dtype == torch.int64
    assert torch.equal(fast.token_ids, ref.token_ids)
    if batch.max_num_logprobs is None:
        assert fast.logprobs is None
    else:
        torch.testing.assert_close(fast.logprobs, ref.logprobs)
        if batch.max_num_logprobs > 0:
            assert torch.equal(fast.top_ids, ref.top_ids)


def test_penalties_and_bias_follow_the_formulas():
    logits = torch.randn(1, VOCAB) * 2
    row = SamplingRow(
        0.0,
        repetition_penalty=1.5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias={9: 2.5},
        prompt_token_ids=[4],
        output_token_ids=[7, 7, 8],
        num_logprobs=0,
    )
    expected = logits[0].clone()
    expected[9] += 2.5
    for token in (4, 7, 8):  # HF/vLLM repetition penalty over prompt and output
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    expected[7] -= 0.2 * 2 + 0.3  # OpenAI: frequency x count + presence, output tokens only
    expected[8] -= 0.2 * 1 + 0.3
    out = sample(logits, build_sampling_batch([row], VOCAB, "cpu"))
    assert int(out.token_ids) == int(expected.argmax())
    torch.testing.assert_close(out.logprobs, torch.log_softmax(expected, -1)[expected.argmax()].view(1))


def test_greedy_fast_path_is_argmax_and_logprobs_are_before_temperature():
    logits = torch.randn(5, VOCAB)
    rows = [SamplingRow(0.0, num_logprobs=3) for _ in range(5)]
    out = sample(logits, build_sampling_batch(rows, VOCAB, "cpu"))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    top = torch.log_softmax(logits, -1).topk(3)
    torch.testing.assert_close(out.top_logprobs, top.values)
    hot = sample(logits, build_sampling_batch([SamplingRow(5.0, seed=1, num_logprobs=0)] * 5, VOCAB, "cpu"))
    expected = torch.log_softmax(logits, -1).gather(1, hot.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(hot.logprobs, expected)  # temperature does not enter the reported logprobs


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(1, VOCAB) * 2
    row = SamplingRow(0.9, top_p=0.95, seed=1234, step=17)
    alone = sample(logits, build_sampling_batch([row], VOCAB, "cpu")).token_ids[0]
    others = [SamplingRow(1.0, seed=s, step=3) for s in range(5)]
    mixed_logits = torch.cat([torch.randn(2, VOCAB), logits, torch.randn(3, VOCAB)])
    mixed = sample(mixed_logits, build_sampling_batch(others[:2] + [row] + others[2:], VOCAB, "cpu")).token_ids
    assert mixed[2] == alone


def test_draws_follow_the_distribution():
    """Across steps of one seed, the race picks token i with probability softmax(l / T)[i] after top-k."""
    num_tokens, num_steps = 12, 6000
    logits = torch.randn(1, num_tokens) * 1.5
    rows = [SamplingRow(0.8, top_k=8, seed=99, step=s) for s in range(num_steps)]
    out = sample(logits.expand(num_steps, -1), build_sampling_batch(rows, num_tokens, "cpu")).token_ids
    scaled = logits[0] / 0.8
    scaled[scaled < scaled.topk(8).values[-1]] = float("-inf")
    target = torch.softmax(scaled, -1)
    freq = torch.bincount(out, minlength=num_tokens).float() / num_steps
    assert 0.5 * (freq - target).abs().sum() < 0.03  # total variation; sampling noise alone is ~0.01
    assert freq[target == 0].sum() == 0


def test_noise_is_exponential_and_independent_per_row():
    seeds = torch.arange(16)
    noise = exponential_noise(seeds & 0xFFFF, seeds * 0, seeds * 0 + 2, 20000)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    corr = torch.corrcoef(noise[:4])
    assert (corr - torch.eye(4)).abs().max() < 0.03
    again = exponential_noise(seeds & 0xFFFF, seeds * 0, seeds * 0 + 2, 20000)
    assert torch.equal(noise, again)
    next_step = exponential_noise(seeds & 0xFFFF, seeds * 0, seeds * 0 + 3, 20000)
    assert not torch.equal(noise, next_step)


def test_flags_skip_work_for_plain_rows():
    batch = build_sampling_batch([SamplingRow(0.0), SamplingRow(0.0)], VOCAB, "cpu")
    assert batch.all_greedy and not (batch.need_penalties or batch.need_bias or batch.need_top_k or batch.need_top_p
                                   or batch.need_min_p)
    assert batch.output_counts is None and batch.logit_bias is None and batch.max_num_logprobs is None
    batch = build_sampling_batch([SamplingRow(1.0, top_k=5), SamplingRow(0.0, top_p=0.5)], VOCAB, "cpu")
    assert batch.need_top_k and not batch.need_top_p  # the greedy row's top_p is never used


def test_sample_makes_no_host_sync():
    rows = [_random_row(random.Random(s)) for s in range(6)]
    batch = build_sampling_batch(rows, VOCAB, "cpu")
    logits = torch.randn(6, VOCAB)
    with assert_no_host_sync():
        sample(logits, batch)


@pytest.mark.parametrize("num_rows, vocab_size, num_chunks", [(1, 1000, 64), (3, 151936, 64), (5, 97, 8), (2, 7, 16)])
def test_two_stage_argmax_is_argmax_with_first_index_on_ties(num_rows, vocab_size, num_chunks):
    logits = torch.randn(num_rows, vocab_size)
    assert torch.equal(two_stage_argmax(logits, num_chunks), torch.argmax(logits, dim=-1))
    ties = torch.randint(0, 3, (num_rows, vocab_size)).float()  # many equal maxima in every row
    assert torch.equal(two_stage_argmax(ties, num_chunks), torch.argmax(ties, dim=-1))
    ties[:, -1] = 9.0  # the maximum in the padded last chunk
    assert torch.equal(two_stage_argmax(ties, num_chunks), torch.full((num_rows,), vocab_size - 1))


def test_plain_greedy_only_without_penalties_bias_or_logprobs():
    assert is_plain_greedy([SamplingRow(temperature=0.0), SamplingRow(temperature=0.0, top_p=0.5)])
    for row in (SamplingRow(temperature=0.7), SamplingRow(temperature=0.0, repetition_penalty=1.1),
                SamplingRow(temperature=0.0, presence_penalty=0.5), SamplingRow(temperature=0.0, frequency_penalty=-1.0),
                SamplingRow(temperature=0.0, logit_bias={3: 1.0}), SamplingRow(temperature=0.0, num_logprobs=0)):
        assert not is_plain_greedy([SamplingRow(temperature=0.0), row])


@pytest.mark.parametrize("num_rows, vocab_size, num_chunks", [(1, 1000, 64), (3, 151936, 64), (5, 97, 8), (2, 7, 16)])
def test_chunked_cumsum_is_cumsum(num_rows, vocab_size, num_chunks):
    values = torch.rand(num_rows, vocab_size, dtype=torch.float64)
    torch.testing.assert_close(chunked_cumsum(values, num_chunks), torch.cumsum(values, dim=-1), rtol=1e-12,
                               atol=1e-12)


def test_host_copies_of_a_fake_are_not_pinned(monkeypatch):
    """The compile child builds sampling batches on fake tensors, which have no memory to pin (CUDA pins host
    copies): the copy still happens, unpinned."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from server.kernels import sampling

    moved = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: moved.append(args) or self)
    with FakeTensorMode():
        sampling._to_device([1.0, 2.0], torch.float32, torch.device("cuda"))
    assert moved == [(torch.device("cuda"),)]
