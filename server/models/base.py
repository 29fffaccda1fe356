"""ModelArgs from a Hugging Face config, the per-step attention metadata, RoPE frequencies, layer kinds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from server.kernels.flex_decode import decode_block_mask
from server.kernels.plan import StepPlan
from server.models.rope import rope_parameters

ATTENTION = "full_attention"  # the layer type of attention layers; any other type keeps a per-sequence state

# Names that differ between checkpoint generations / transformers versions -> our field name.
CONFIG_ALIASES = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts"}


def reject_sliding_window(config: dict[str, Any]) -> None:
    """transformers applies `sliding_window` unless `use_sliding_window` is false (Qwen's switch, which leaves
    the window size in config.json unused); attention here is always full causal."""
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", True):
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported: attention here is "
                         "full causal")


@dataclass
class BaseModelArgs:
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]):
        """Build from config.json, dropping keys this architecture does not declare. Raises ValueError for
        settings that change the math but are not implemented (rope types, sliding windows)."""
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config and name not in config:
                config[name] = config[alias]
        reject_sliding_window(config)
        config["rope_parameters"] = rope_parameters(config)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


@dataclass
class AttentionMetadata:
    """Per-step layout of a flat batch of tokens from several sequences over the paged KV cache.

    Tokens of the step are flat `[num_tokens]`; attention runs on a padded `[num_seqs, max_q_len]` view.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64
    query_index: torch.Tensor  # [num_seqs, max_q_len] int64: flat token index (padding points at 0)
    query_positions: torch.Tensor  # [num_seqs, max_q_len] int64: absolute position (padding 0)
    token_rows: torch.Tensor  # [num_tokens] int64: the sequence row of each flat token
    token_cols: torch.Tensor  # [num_tokens] int64: its column in the padded view
    # Hybrid models only (short-conv / Gated DeltaNet layers); None for pure attention models.
    query_lens: torch.Tensor | None = None  # [num_seqs] int64: valid tokens of each padded row
    state_slots: torch.Tensor | None = None  # [num_seqs] int64: each sequence's slot in the state pool
    state_caches: list[tuple[torch.Tensor, ...]] | None = None  # per state layer: tensors [num_slots, ...]
    is_decode: bool = False  # one token per sequence: rows of the flat batch are the sequences
    decode_block_mask: Any = None  # flex decode attention: the step's FlexAttention BlockMask (else SDPA)
    fresh_prefill: bool = False  # every sequence starts at position 0: attention needs only the step's own K/V

    @classmethod
    def for_decode(cls, slot_mapping, block_tables, positions, flex: bool, kv_cache: torch.Tensor,
                   plan: StepPlan, **state):
        """One token per sequence, rows in order. `kv_cache`: any attention layer's cache (all share the block
        layout); with `flex` the step's BlockMask over it is built here, once for all layers, in the plan's form."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        meta = cls(
            slot_mapping=slot_mapping, block_tables=block_tables, query_index=rows[:, None],
            query_positions=positions[:, None], token_rows=rows, token_cols=torch.zeros_like(rows),
            is_decode=True, **state,
        )
        if flex:
            num_blocks, block_size = kv_cache.shape[:2]
            meta.decode_block_mask = decode_block_mask(block_tables, positions, block_size, num_blocks * block_size,
                                                       plan.flex_listed_blocks)
        return meta


def is_moe_layer(args, layer_idx: int) -> bool:
    """Qwen3-MoE / Qwen3-Next: every `decoder_sparse_step`-th layer is MoE, except the `mlp_only_layers`."""
    return (
        args.num_experts > 0
        and layer_idx not in args.mlp_only_layers
        and (layer_idx + 1) % args.decoder_sparse_step == 0
    )
