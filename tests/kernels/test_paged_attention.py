"""Paged attention (prefill and decode forms) against a naive per-sequence causal attention, fresh inputs."""

from __future__ import annotations

import pytest
import torch

from server.kernels import flex_decode, flex_probe
from server.kernels.flex_decode import decode_block_mask
from server.kernels.paged_attention import gathered_decode_attention, paged_attention, prefill_sdpa_backends, write_kv
from server.kernels.plan import step_plan
from server.models.base import AttentionMetadata

EAGER = step_plan("cpu", torch.float32)


def naive(q, k, v, scale):  # q [T, H, D] for positions start..start+T-1; k, v [S, Hkv, D] for positions 0..S-1
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    start = k.shape[0] - q.shape[0]
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.double()).float()


def build_case(seed: int, lens: list[tuple[int, int]], block_size=4, heads=4, kv_heads=2, dim=8):
    """lens: (num_cached, num_new) per sequence. Returns q, caches, meta, expected output."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    qs, ks, vs, slots, rows, cols, expected = [], [], [], [], [], [], []
    max_q, max_blocks = max(n for _, n in lens), max(-(-(c + n) // block_size) for c, n in lens)
    tables, query_index, query_pos = [], [], []
    for row, (cached, new) in enumerate(lens):
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        k_all = torch.randn(total, kv_heads, dim, generator=gen)
        v_all = torch.randn(total, kv_heads, dim, generator=gen)
        for pos in range(cached):  # already in the cache
            k_cache[blocks[pos // block_size], pos % block_size] = k_all[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v_all[pos]
        q = torch.randn(new, heads, dim, generator=gen)
        qi = []
        for j in range(new):
            pos = cached + j
            qi.append(len(slots))
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            rows.append(row)
            cols.append(j)
        qs.append(q)
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        expected.append(naive(q, k_all, v_all, dim**-0.5))
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        query_index.append(qi + [0] * (max_q - new))
        query_pos.append([cached + j for j in range(new)] + [0] * (max_q - new))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables), query_index=torch.tensor(query_index),
        query_positions=torch.tensor(query_pos), token_rows=torch.tensor(rows), token_cols=torch.tensor(cols),
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, torch.cat(expected)


def layer_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One layer's cache in the engine's layout: one [blocks, block, 2, kv_heads, dim] tensor."""
    return torch.stack((k_cache, v_cache), dim=2).contiguous()


@pytest.mark.parametrize("seed, heads, kv_heads", [(0, 4, 2), (1, 4, 2), (2, 4, 2), (6, 3, 3), (7, 6, 2), (8, 4, 1)])
def test_mixed_prefill_and_decode_batch(seed, heads, kv_heads):
    """Each KV head's query group folded into SDPA's query rows, for groups of 1 (no GQA) to 4, with the
    chunks' causal masks."""
    q, k, v, k_cache, v_cache, meta, expected = build_case(seed, [(0, 7), (9, 1), (5, 6), (13, 1)], heads=heads,
                                                            kv_heads=kv_heads)
    k_cache, v_cache = write_kv(layer_cache(k_cache, v_cache), k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, EAGER)
    assert (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("seed, heads, kv_heads", [(3, 4, 2), (4, 4, 2), (9, 2, 2), (10, 8, 2)])
def test_decode_form_matches(seed, heads, kv_heads):
    q, k, v, k_cache, v_cache, meta, expected = build_case(seed, [(11, 1), (2, 1), (30, 1)], heads=heads, kv_heads=kv_heads)
    k_cache, v_cache = write_kv(layer_cache(k_cache, v_cache), k, v, meta.slot_mapping)
    out = gathered_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.query_positions[:, 0], q.shape[-1] ** -0.5)
    assert (out - expected).abs().max() < 1e-5
    meta.is_decode = True  # one query per sequence: the decode form, query rows taken as views
    out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, EAGER)
    assert out.shape == q.shape and (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("lens", [[(0, 9)], [(0, 7), (0, 3), (0, 12)]])
def test_fresh_prefill_attends_over_the_step_alone(lens):
    """Sequences starting at position 0: causal SDPA over the step's own K/V. The caches are left full of NaN,
    so the result is right only if they are not read."""
    q, k, v, k_cache, v_cache, meta, expected = build_case(5, lens)
    meta.fresh_prefill = True
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, EAGER)
    assert out.shape == q.shape
    assert (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("seed, lens", [(6, [(11, 1), (2, 1), (30, 1)]), (7, [(0, 1), (3, 1)]), (8, [(15, 1)])])
def test_flex_decode_matches(seed, lens):
    """FlexAttention over the physical cache with the step's BlockMask (eager here: the fused kernel is
    CUDA's; the engine's start-up probe checks it there). Unused cache slots hold NaN-free noise that must not
    be attended, so a wrong mask shows."""
    q, k, v, k_cache, v_cache, meta, expected = build_case(seed, lens)
    k_cache, v_cache = write_kv(layer_cache(k_cache, v_cache), k, v, meta.slot_mapping)
    positions = meta.query_positions[:, 0]
    meta.is_decode = True
    meta.decode_block_mask = decode_block_mask(meta.block_tables, positions, k_cache.shape[1],
                                               k_cache.shape[0] * k_cache.shape[1], EAGER.flex_listed_blocks)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, EAGER)
    assert out.shape == q.shape and (out - expected).abs().max() < 1e-5


def test_flex_probe_accepts_a_right_kernel_and_names_a_wrong_or_failing_one(monkeypatch):
    """The probe that gates flex decode attention on a device, run with torch.compile replaced by eager (the
    eager FlexAttention is right) and then with a kernel that is off by a little, or raises."""
    probe = flex_probe.probe_compiled.__wrapped__  # uncached
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(flex_probe, "step_plan", lambda device, dtype, traced: step_plan(device, dtype))  # eager forms
    ok, reason = probe("cpu", torch.float32, 4)
    assert ok, reason
    right = flex_decode.flex_decode_attention
    monkeypatch.setattr(flex_probe, "flex_decode_attention", lambda *a: right(*a) * 1.01)
    ok, reason = probe("cpu", torch.float32, 4)
    assert not ok and "wrong here" in reason

    def broken(*args):
        raise RuntimeError("no kernel for this mask")

    monkeypatch.setattr(flex_probe, "flex_decode_attention", broken)
    assert probe("cpu", torch.bfloat16, 16) == (False, "compiling it failed: RuntimeError: no kernel for this mask")


def test_prefill_leaves_cudnn_attention_out_on_cuda_only():
    """cuDNN attention plans every new shape, and prefill shapes are new at almost every step: on CUDA the prefill context enables flash, memory-efficient and math, and restores the flags after."""
    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    with prefill_sdpa_backends(torch.device("cuda")):
        assert not flags.cudnn_sdp_enabled()
        assert flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
    with prefill_sdpa_backends(torch.device("cpu")):
        assert flags.cudnn_sdp_enabled() == before[0]  # other devices: untouched


def test_kv_write_fills_k_and_v_side_by_side_and_reads_through_views():
    """One scatter puts each token's K at index 0 and V at 1 of dim 2 of its slot, and the K/V returned to attend
    over are views of the cache tensor (no copy)."""
    _, k, v, k_cache, v_cache, meta, _ = build_case(9, [(0, 5), (7, 1), (3, 4)])
    cache = layer_cache(k_cache, v_cache)
    read_k, read_v = write_kv(cache, k, v, meta.slot_mapping)
    block_size = cache.shape[1]
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    assert torch.equal(cache[blocks, offsets, 0], k) and torch.equal(cache[blocks, offsets, 1], v)
    assert torch.equal(read_k, cache[:, :, 0]) and torch.equal(read_v, cache[:, :, 1])
    assert read_k.data_ptr() == cache.data_ptr() and read_v.untyped_storage().data_ptr() == cache.data_ptr()
