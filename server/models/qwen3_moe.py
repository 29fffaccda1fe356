"""Qwen3-MoE: Qwen3 attention; MoE layers with a softmax router (norm_topk_prob) and no shared expert."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from server.models import qwen3
from server.models.base import is_moe_layer
from server.models.layers import SoftmaxMoE


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "qwen3_moe"
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)


class Model(qwen3.Model):
    def make_mlp(self, layer_idx: int) -> nn.Module:
        args = self.args
        if not is_moe_layer(args, layer_idx):
            return super().make_mlp(layer_idx)
        return SoftmaxMoE(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.norm_topk_prob
        )
