"""Decode attention as one FlexAttention call over the paged KV cache: no gathered copy of a sequence's K/V,
no repeated KV heads, no boolean mask tensor.

The cache is viewed as one long physical sequence `[1, kv_heads, num_blocks * block_size, head_dim]`; a
BlockMask built from the block table lists each sequence's physical blocks (its KV block size is the cache
block size) and masks keys past the query's position. Compiled on CUDA this is inductor's flex-decoding kernel,
which needs a static batch size (the engine uses it in the batch-1 decode graph). Whether the compiled form is
right on a device is not assumed from the torch version: `probe_compiled` compiles it there on a small paged
cache and compares it with the gathered SDPA reference before an engine may use it. SDPA is the portable decode.
"""

from __future__ import annotations

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    BlockMask = flex_attention = None

# One query per sequence fits any query block; 128 is a multiple of every kernel's BLOCK_M.
Q_BLOCK_SIZE = 128


def decode_block_mask(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, num_slots: int,
                      listed_blocks: bool):
    """BlockMask for one query per sequence at `positions [num_seqs]` over the blocks of `block_tables
    [num_seqs, max_blocks]`. Every block is listed as partial: with full blocks, torch's flex-decoding kernel
    splits the whole physical cache length across its programs instead of the sequence's own blocks.
    `listed_blocks` (StepPlan.flex_listed_blocks: a compiled step) masks right on the listed blocks only, else on
    the whole cache (eager)."""
    num_seqs, max_blocks = block_tables.shape
    num_cache_blocks = num_slots // block_size  # the mask's KV extent is its index rows' length: pad to the cache
    num_blocks = positions // block_size + 1  # [num_seqs]
    if listed_blocks:
        if not isinstance(num_seqs, int):  # torch would use its general kernel, which this mask is wrong for
            raise RuntimeError("flex decode attention needs a static batch size (DecodeGraphs marks it static)")
        visible = _listed_blocks_mask(block_tables, positions, block_size)
    else:
        visible = _whole_cache_mask(block_tables, positions, block_size, num_blocks, num_cache_blocks)
    indices = torch.nn.functional.pad(block_tables.to(torch.int32), (0, num_cache_blocks - max_blocks))
    return BlockMask.from_kv_blocks(
        num_blocks.to(torch.int32).view(num_seqs, 1, 1),
        indices.view(num_seqs, 1, 1, num_cache_blocks),
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=visible,
        seq_lengths=(1, num_slots),
        compute_q_blocks=False,
    )


def _listed_blocks_mask(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int):
    """Right on the sequence's listed blocks, which are all the decoding kernel visits: only the query's own
    block is cut, past its position. Only the decoding kernel (static batch) visits just the listed blocks;
    the whole-cache form below is wrong compiled, and the general kernel (dynamic batch) is wrong with either,
    hence the static-batch guard."""
    last_physical = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]  # [num_seqs]
    last_offset = positions % block_size

    def visible(batch, head, q_idx, kv_idx):
        return (kv_idx // block_size != last_physical[batch]) | (kv_idx % block_size <= last_offset[batch])

    return visible


def _whole_cache_mask(block_tables, positions, block_size: int, num_blocks, num_cache_blocks: int):
    """Right on every physical slot, as the eager FlexAttention (which ignores the block lists) needs: an
    inverse block table maps a slot back to the sequence's logical position. Table columns past the query's
    block are padding: they scatter into a spare last column nobody reads."""
    num_seqs, max_blocks = block_tables.shape
    columns = torch.arange(max_blocks, device=positions.device).expand(num_seqs, -1)  # [num_seqs, max_blocks]
    targets = torch.where(columns < num_blocks[:, None], block_tables, num_cache_blocks)
    unmapped = torch.full((num_seqs, num_cache_blocks + 1), -1, dtype=torch.int64, device=positions.device)
    logical_block = unmapped.scatter(1, targets, columns)

    def visible(batch, head, q_idx, kv_idx):
        logical = logical_block[batch, kv_idx // block_size]
        return (logical >= 0) & (logical * block_size + kv_idx % block_size <= positions[batch])

    return visible


def flex_decode_attention(
    q: torch.Tensor,  # [num_seqs, heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_mask,  # decode_block_mask(...) of this step, built once for all layers
    scale: float,
    kv_tile: bool,  # StepPlan.flex_kv_tile: bound the kernel's KV tile by the cache block (the Triton kernel)
) -> torch.Tensor:
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    keys = k_cache.view(1, num_slots, kv_heads, head_dim).transpose(1, 2)  # [1, kv_heads, num_slots, head_dim]
    values = v_cache.view(1, num_slots, kv_heads, head_dim).transpose(1, 2)
    out = flex_attention(
        q.unsqueeze(2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != kv_heads,
        kernel_options=_kernel_options(block_size, kv_tile),
    )
    return out[:, :, 0]  # [num_seqs, heads, head_dim]


def _kernel_options(block_size: int, kv_tile: bool) -> dict | None:
    """The Triton kernel's KV tile must divide the cache block (its sparse block); the CPU template picks its own."""
    return {"BLOCK_N": min(block_size, 64)} if kv_tile else None
