"""Gated DeltaNet and causal-conv kernels against their token-by-token twins, on fresh random inputs."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from server.kernels import gated_delta as gd


def _inputs(num_rows, seq_len, k_heads=2, v_heads=4, k_dim=16, v_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(num_rows, seq_len, k_heads, k_dim), randn(num_rows, seq_len, k_heads, k_dim)
    v = randn(num_rows, seq_len, v_heads, v_dim)
    g = -F.softplus(randn(num_rows, seq_len, v_heads))  # log decay <= 0
    beta = torch.sigmoid(randn(num_rows, seq_len, v_heads))
    state = randn(num_rows, v_heads, k_dim, v_dim)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [2, 63, 64, 65, 150])
def test_chunked_matches_token_by_token(seq_len):
    q, k, v, g, beta, state = _inputs(3, seq_len, seed=seq_len)
    out, new_state = gd.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64)
    ref_out, ref_state = gd.gated_delta_rule_reference(q, k, v, g, beta, state)
    assert out.shape == ref_out.shape == (3, seq_len, 4, 8)
    assert (out - ref_out).abs().max().item() < 1e-4
    assert (new_state - ref_state).abs().max().item() < 1e-4


def test_chunk_size_does_not_change_the_result():
    q, k, v, g, beta, state = _inputs(2, 100, seed=5)
    out64, state64 = gd.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64)
    out16, state16 = gd.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    assert (out64 - out16).abs().max().item() < 1e-4 and (state64 - state16).abs().max().item() < 1e-4


def test_recurrent_step_matches_reference_and_continues_a_prefill():
    q, k, v, g, beta, state = _inputs(4, 41, seed=9)
    _, mid = gd.chunk_gated_delta_rule(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], state)
    out, new_state = gd.recurrent_gated_delta_step(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], mid)
    ref_out, ref_state = gd.gated_delta_rule_reference(q, k, v, g, beta, state)
    assert (out[:, 0] - ref_out[:, 40]).abs().max().item() < 1e-4
    assert (new_state - ref_state).abs().max().item() < 1e-4


@pytest.mark.parametrize("compiled", [False, True])
def test_decode_step_updates_the_state_cache_in_place(compiled):
    """Rows at permuted slots of a larger cache of transposed states (S^T): outputs and new states match the
    reference, other slots are untouched. Compiled, the step takes the fused form (state read in place, o from
    the old state)."""
    if compiled and shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("inductor needs a C compiler")
    q, k, v, g, beta, state = _inputs(3, 1, seed=21)
    cache = torch.randn(7, *state.transpose(-1, -2).shape[1:], generator=torch.Generator().manual_seed(22))
    slots = torch.tensor([5, 0, 3])
    cache[slots] = state.transpose(-1, -2)
    before = cache.clone()
    step = torch.compile(gd.gated_delta_decode_, fullgraph=True) if compiled else gd.gated_delta_decode_
    out = step(q, k, v, g, beta, cache, slots, compiled)
    ref_out, ref_state = gd.gated_delta_rule_reference(q, k, v, g, beta, state)
    assert out.shape == ref_out.shape and (out - ref_out).abs().max().item() < 1e-4
    assert (cache[slots].transpose(-1, -2) - ref_state).abs().max().item() < 1e-4
    others = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(cache[others], before[others])


def test_padding_with_zero_gates_leaves_the_state_alone():
    """Rows of a batch end at different lengths: g = beta = 0 after the end keeps each row's state exact."""
    q, k, v, g, beta, state = _inputs(3, 70, seed=13)
    lengths = torch.tensor([70, 5, 33])
    valid = (torch.arange(70)[None, :] < lengths[:, None])[..., None]
    _, padded_state = gd.gated_delta_rule(q, k, v, g * valid, beta * valid, state)
    for row, n in enumerate(lengths.tolist()):
        one = (t[row : row + 1, :n] for t in (q, k, v, g, beta))
        _, ref_state = gd.gated_delta_rule_reference(*one, state[row : row + 1])
        assert (padded_state[row] - ref_state[0]).abs().max().item() < 1e-4


def test_bf16_inputs_keep_an_fp32_state():
    q, k, v, g, beta, state = _inputs(2, 80, seed=17)
    out, new_state = gd.gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    ref_out, ref_state = gd.gated_delta_rule_reference(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and new_state.dtype == torch.float32
    assert (out.float() - ref_out).abs().max().item() < 0.1 * ref_out.abs().max().item()


@pytest.mark.parametrize("seq_len", [1, 7])
def test_causal_conv1d_matches_reference_with_state(seq_len):
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(3, seq_len, 12, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    state = torch.randn(3, 12, 3, generator=gen)
    lengths = torch.tensor([seq_len, 1, max(seq_len - 2, 1)])
    y, new_state = gd.causal_conv1d(x, weight, state, lengths)
    ref_y, ref_state = gd.causal_conv1d_reference(x, weight, state, lengths)
    for row, n in enumerate(lengths.tolist()):  # outputs past a row's length are padding
        assert (y[row, :n] - ref_y[row, :n]).abs().max().item() < 1e-5
    assert (new_state - ref_state).abs().max().item() == 0.0


def test_causal_conv1d_in_chunks_equals_one_pass():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 20, 6, generator=gen), torch.randn(6, 3, generator=gen)
    zero = torch.zeros(2, 6, 2)
    full, _ = gd.causal_conv1d(x, weight, zero, torch.tensor([20, 20]))
    first, state = gd.causal_conv1d(x[:, :11], weight, zero, torch.tensor([11, 11]))
    second, _ = gd.causal_conv1d(x[:, 11:], weight, state, torch.tensor([9, 9]))
    assert (torch.cat([first, second], dim=1) - full).abs().max().item() < 1e-5


def test_compiled_qk_normalization_is_one_reduction():
    """Compiled, q and k heads are L2-normed as one tensor (one reduction kernel where each took one), with the
    eager values (q scaled by dk^-0.5, key heads repeated to the value heads)."""
    sums = []

    def record(graph_module, example_inputs):
        sums.extend(n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method")
                    and getattr(n.target, "__name__", n.target) == "sum")
        return graph_module.forward

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 3, 4, 16, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: gd._normalize_qk(a, b, 8), backend=record, fullgraph=True)
    got, expected = compiled(q, k), gd._normalize_qk(q, k, 8)
    assert len(sums) == 1
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape == (2, 3, 8, 16)
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
