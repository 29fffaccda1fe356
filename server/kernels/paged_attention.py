"""Attention over a paged KV cache, and writing new K/V into it.

Cache layout per layer: K and V `[num_blocks, block_size, num_kv_heads, head_dim]`, apart or side by side in
one tensor (see write_kv). A step's tokens come flat; `meta` (server.models.base.AttentionMetadata, passed
duck-typed to keep kernels free of models) maps them onto a padded `[num_seqs, max_q_len]` query view.

Three forms: a step whose sequences all start at position 0 (a fresh prompt's first chunk) attends over its
own K/V with causal SDPA; the compiled decode step can use `paged_decode_attention` (the gather fused into
two reductions) or `flex_decode_attention` (one FlexAttention kernel, CUDA); everything else gathers each
sequence's blocks and runs SDPA with a boolean mask.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from server.kernels.flex_decode import flex_decode_attention


def kv_block_dims(kv_cache) -> tuple[int, int]:
    """(num_blocks, block_size) of one layer's cache, in either layout (a (K, V) pair or one combined tensor)."""
    num_blocks, block_size = (kv_cache if isinstance(kv_cache, torch.Tensor) else kv_cache[0]).shape[:2]
    return num_blocks, block_size


def write_kv(kv_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter this step's K/V `[num_tokens, kv_heads, head_dim]` into their cache slots, in place; returns the
    layer's K and V caches `[num_blocks, block_size, kv_heads, head_dim]` to attend over.

    kv_cache: a (K, V) pair of such tensors, or one `[num_blocks, block_size, 2, kv_heads, head_dim]` tensor
    (EngineConfig.kv_layout "combined": one scatter per layer instead of two; H200, benchmarks/kv_write.py: 1.07
    vs 1.91 us per layer at batch 1). index_put_ on the cache tensor itself (not on a reshaped view) so
    torch.compile updates it in place; mutating a view made torch 2.11's inductor copy the whole cache every step
    (measured: docs/PERF.md)."""
    _, block_size = kv_block_dims(kv_cache)
    slots = (slot_mapping // block_size, slot_mapping % block_size)  # (block, offset in block) per token
    if isinstance(kv_cache, torch.Tensor):
        kv_cache.index_put_(slots, torch.stack((k, v), dim=1).to(kv_cache.dtype))
        return kv_cache[:, :, 0], kv_cache[:, :, 1]
    k_cache, v_cache = kv_cache
    k_cache.index_put_(slots, k.to(k_cache.dtype))
    v_cache.index_put_(slots, v.to(v_cache.dtype))
    return k_cache, v_cache


def prefill_sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends around every forward outside the compiled decode step (prefill, mixed and eager decode
    steps), whose shapes are new at almost every step (prompt and KV lengths vary). cuDNN attention builds a
    plan per new shape: on the H200 (torch 2.11) its first call on a fresh shape took 45-75 ms, flash and
    memory-efficient attention 0.1-1.3 ms, and they were faster on repeats too (benchmarks/sdpa_shapes.py,
    docs/PERF.md session 7). So cuDNN is left out."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
) -> torch.Tensor:
    """Causal GQA attention of `q [num_tokens, heads, head_dim]` over each sequence's cached K/V (`k`, `v`:
    this step's own `[num_tokens, kv_heads, head_dim]`, enough when no sequence has earlier tokens)."""
    if meta.is_decode and meta.decode_kernel == "reduce" and torch.compiler.is_compiling():
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.query_positions[:, 0], scale)
    if meta.decode_block_mask is not None:
        return flex_decode_attention(q, k_cache, v_cache, meta.decode_block_mask, scale)
    if meta.fresh_prefill:
        return fresh_prefill_attention(q, k, v, meta, scale)
    num_seqs, max_blocks = meta.block_tables.shape
    block_size = k_cache.shape[1]
    if meta.is_decode:  # one query per sequence, rows in order: views instead of two gathers per layer
        q_pad = q[:, None].transpose(1, 2)  # [num_seqs, heads, 1, head_dim]
    else:
        q_pad = q[meta.query_index].transpose(1, 2)  # [num_seqs, heads, max_q_len, head_dim]
    k_seq = k_cache[meta.block_tables].view(num_seqs, max_blocks * block_size, *k_cache.shape[2:]).transpose(1, 2)
    v_seq = v_cache[meta.block_tables].view(num_seqs, max_blocks * block_size, *v_cache.shape[2:]).transpose(1, 2)
    key_pos = torch.arange(max_blocks * block_size, device=q.device)
    mask = key_pos[None, None, :] <= meta.query_positions[:, :, None]  # [num_seqs, max_q_len, max_kv_len]
    out = attention_reference(q_pad, k_seq, v_seq, mask[:, None], scale)  # [num_seqs, heads, max_q_len, head_dim]
    if meta.is_decode:
        return out[:, :, 0]  # [num_seqs, heads, head_dim]
    return out.transpose(1, 2)[meta.token_rows, meta.token_cols]  # [num_tokens, heads, head_dim]


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Every sequence of the step starts at position 0, so its keys are exactly this step's: causal SDPA over
    the padded chunk, with no gather of cache blocks, no boolean mask and no repeated KV heads (so the fused
    causal kernels apply). Right padding is safe: a valid query never sees a later (padded) key."""
    gqa = q.shape[1] != k.shape[1]
    if meta.query_index.shape[0] == 1:  # one sequence: its tokens are the step's, in order
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
    q_pad, k_pad, v_pad = (t[meta.query_index].transpose(1, 2) for t in (q, k, v))  # [num_seqs, *, max_q_len, dim]
    out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)[meta.token_rows, meta.token_cols]  # [num_tokens, heads, head_dim]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with a boolean mask; KV heads are shared by `heads // kv_heads` query heads (GQA)."""
    num_groups = q.shape[1] // k.shape[1]
    if num_groups > 1:
        k = k.repeat_interleave(num_groups, dim=1)
        v = v.repeat_interleave(num_groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    positions: torch.Tensor,  # [num_seqs]: the query's position; keys 0..position are visible
    scale: float,
) -> torch.Tensor:
    """Decode attention written as broadcast-multiply-and-reduce over the block-table gather, so that
    torch.compile fuses the gather into the reductions and never materializes a sequence's KV copy.
    (Eager, this form would materialize large products: the eager path uses SDPA instead.)"""
    num_seqs, heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    groups = heads // num_kv_heads
    max_kv_len = block_tables.shape[1] * k_cache.shape[1]
    keys = k_cache[block_tables].view(num_seqs, max_kv_len, num_kv_heads, 1, head_dim)
    values = v_cache[block_tables].view(num_seqs, max_kv_len, num_kv_heads, 1, head_dim)
    q_g = q.view(num_seqs, 1, num_kv_heads, groups, head_dim).float()
    scores = (q_g * keys.float()).sum(-1) * scale  # [num_seqs, max_kv_len, kv_heads, groups]
    visible = torch.arange(max_kv_len, device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * values.float()).sum(1)  # [num_seqs, kv_heads, groups, head_dim]
    return out.view(num_seqs, heads, head_dim).to(q.dtype)
