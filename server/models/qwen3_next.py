"""Qwen3-Next (80B-A3B): the Qwen3.5-MoE hybrid with a flat config, grouped `in_proj_qkvz` / `in_proj_ba`
Gated DeltaNet projections (un-grouped while loading), per-expert tensors, optional dense layers
(`mlp_only_layers`, `decoder_sparse_step`) and `norm_topk_prob`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from server.models import qwen3_5
from server.models.base import is_moe_layer
from server.models.hybrid import (
    HybridModel,
    SharedExpertMoE,
    gated_hybrid_layer,
    split_grouped_projections,
)
from server.models.layers import GatedMLP


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_key_value_heads: int = 2
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)


class Model(HybridModel):
    ignored_prefixes = ("model.visual.", "mtp.")
    zero_centered_norms = True
    shared_expert_slots = True

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        args = self.args
        if is_moe_layer(args, layer_idx):
            ffn = SharedExpertMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                                  args.moe_intermediate_size, args.shared_expert_intermediate_size, args.norm_topk_prob)
        else:
            ffn = GatedMLP(args.hidden_size, args.intermediate_size)
        return gated_hybrid_layer(args, layer_type, ffn, self.make_norm)

    def split_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Loader hook: grouped GDN projections -> the Qwen3.5 rows `GatedDeltaNet.in_proj` declares."""
        args = self.args
        ratio = args.linear_num_value_heads // args.linear_num_key_heads
        return split_grouped_projections(
            name, tensor, args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim, ratio
        )
