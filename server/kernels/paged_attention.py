"""Attention over a paged KV cache, and writing new K/V into it.

Cache layout per layer: one `[num_blocks, block_size, 2, num_kv_heads, head_dim]` tensor, K and V side by side
(see write_kv). A step's tokens come flat; `meta` (server.models.base.AttentionMetadata, passed
duck-typed to keep kernels free of models) maps them onto a padded `[num_seqs, max_q_len]` query view.

Three forms: a step whose sequences all start at position 0 (a fresh prompt's first chunk) attends over its
own K/V with causal SDPA; the compiled batch-1 decode step on CUDA can use `flex_decode_attention` (one
FlexAttention kernel); everything else gathers each sequence's blocks and runs SDPA with a boolean mask, each KV
head's query group as SDPA's query rows (attention_reference).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from server.kernels import devices
from server.kernels.flex_decode import flex_decode_attention
from server.kernels.plan import StepPlan


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter this step's K/V `[num_tokens, kv_heads, head_dim]` into their slots of the layer's cache
    `[num_blocks, block_size, 2, kv_heads, head_dim]` (K and V side by side: one scatter per layer), in place;
    returns the K and V views `[num_blocks, block_size, kv_heads, head_dim]` to attend over.

    index_put_ on the cache tensor itself (not on a reshaped view) so torch.compile updates it in place;
    mutating a view makes inductor copy the whole cache every step."""
    block_size = kv_cache.shape[1]
    slots = (slot_mapping // block_size, slot_mapping % block_size)  # (block, offset in block) per token
    kv_cache.index_put_(slots, torch.stack((k, v), dim=1).to(kv_cache.dtype))
    return kv_cache[:, :, 0], kv_cache[:, :, 1]


def prefill_sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends around every forward outside the compiled decode step (prefill, mixed and eager decode
    steps), whose shapes are new at almost every step (prompt and KV lengths vary). cuDNN attention builds a
    plan per new shape, which costs far more than the attention itself, so it is left out."""
    if not devices.has_cudnn_attention(device):
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
    plan: StepPlan,
) -> torch.Tensor:
    """Causal GQA attention of `q [num_tokens, heads, head_dim]` over each sequence's cached K/V (`k`, `v`:
    this step's own `[num_tokens, kv_heads, head_dim]`, enough when no sequence has earlier tokens)."""
    if meta.decode_block_mask is not None:
        return flex_decode_attention(q, k_cache, v_cache, meta.decode_block_mask, scale, plan.flex_kv_tile)
    if meta.fresh_prefill:
        return fresh_prefill_attention(q, k, v, meta, scale)
    if meta.is_decode:
        return gathered_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.query_positions[:, 0], scale)
    k_seq, v_seq = (_gather_blocks(cache, meta.block_tables) for cache in (k_cache, v_cache))
    key_pos = torch.arange(k_seq.shape[2], device=q.device)
    mask = key_pos[None, None, :] <= meta.query_positions[:, :, None]  # [num_seqs, max_q_len, max_kv_len]
    q_pad = q[meta.query_index].transpose(1, 2)  # [num_seqs, heads, max_q_len, head_dim]
    out = attention_reference(q_pad, k_seq, v_seq, mask[:, None], scale)  # [num_seqs, heads, max_q_len, head_dim]
    return out.transpose(1, 2)[meta.token_rows, meta.token_cols]  # [num_tokens, heads, head_dim]


def gathered_decode_attention(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]: one query per sequence, rows in order
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    positions: torch.Tensor,  # [num_seqs]: the query's position; keys 0..position are visible
    scale: float,
) -> torch.Tensor:
    """Each sequence's blocks gathered, then SDPA with a boolean mask: the portable decode attention, and the
    reference the flex form is checked against. q is viewed, not gathered."""
    k_seq, v_seq = (_gather_blocks(cache, block_tables) for cache in (k_cache, v_cache))
    visible = torch.arange(k_seq.shape[2], device=q.device)[None, :] <= positions[:, None]  # [num_seqs, max_kv_len]
    out = attention_reference(q[:, :, None], k_seq, v_seq, visible[:, None, None], scale)
    return out[:, :, 0]  # [num_seqs, heads, head_dim]


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, head_dim] -> each sequence's keys in order [num_seqs, kv_heads, len, dim]."""
    num_seqs, max_blocks = block_tables.shape
    block_size = cache.shape[1]
    return cache[block_tables].view(num_seqs, max_blocks * block_size, *cache.shape[2:]).transpose(1, 2)


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
    """SDPA of `q [num_seqs, heads, q_len, head_dim]` over `k`, `v [num_seqs, kv_heads, kv_len, head_dim]` with a
    boolean mask broadcastable to `[num_seqs, 1, q_len, kv_len]`. Each KV head serves `heads // kv_heads` query
    heads (GQA): the group is folded into SDPA's query axis, so every backend reads each KV head once, with no
    repeated copy of K/V and no GQA support asked of the kernel."""
    num_seqs, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    num_groups = heads // kv_heads
    if num_groups > 1:  # query head h reads KV head h // num_groups
        q = q.reshape(num_seqs, kv_heads, num_groups * q_len, head_dim)
        if q_len > 1:  # row g * q_len + t is query t's: the mask's rows once per group member (one row broadcasts)
            mask = mask.expand(num_seqs, 1, q_len, kv_len).repeat(1, 1, num_groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, heads, q_len, head_dim)
