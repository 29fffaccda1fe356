"""Qwen3-MoE: Qwen3 attention; MoE layers with a softmax router (norm_topk_prob) and no shared expert."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from server.models import llama
from server.models.base import is_moe_layer
from server.models.layers import CausalLM, GatedMLP, SoftmaxMoE, attention_decoder_layer


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3_moe"
    head_dim: int | None = 128
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)


class Model(CausalLM):
    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        args = self.args
        if is_moe_layer(args, layer_idx):
            ffn = SoftmaxMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                             args.norm_topk_prob)
        else:
            ffn = GatedMLP(args.hidden_size, args.intermediate_size)
        return attention_decoder_layer(args, ffn, self.make_norm, qk_norm=True)
