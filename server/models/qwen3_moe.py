"""Qwen3-MoE: Qwen3 attention; MoE layers with a softmax router (norm_topk_prob) and no shared expert."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from server.models import qwen3
from server.models.layers import GatedMLP, SoftmaxMoE


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "qwen3_moe"
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


class Model(qwen3.Model):
    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        if not args.is_moe_layer(layer_idx):
            return GatedMLP(args.hidden_size, args.intermediate_size)
        return SoftmaxMoE(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.norm_topk_prob
        )
