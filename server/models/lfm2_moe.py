"""LFM2-MoE (LFM2-8B-A1B, LFM2.5-8B-A1B): LFM2 with dense leading layers and sigmoid-routed experts.

The router takes `sigmoid(gate(x))` in the model dtype and picks experts by `top_k(s + expert_bias)` with the
fp32 `expert_bias` buffer; the weights are the unbiased scores, renormalized. No shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from server.models import lfm2
from server.models.hybrid import HybridModel, SigmoidBiasMoE, lfm2_layer
from server.models.layers import GatedMLP, RMSNorm


@dataclass
class ModelArgs(lfm2.ModelArgs):
    model_type: str = "lfm2_moe"
    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_hidden_layers: int = 32
    num_dense_layers: int = 2
    num_experts: int = 32
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def default_layer_types(self) -> list[str]:
        if self.full_attn_idxs is None:
            raise ValueError("an lfm2_moe config must list layer_types (or full_attn_idxs); it has neither")
        return super().default_layer_types()

    def dense_ffn_size(self) -> int:
        return self.intermediate_size  # the MoE family sizes its dense layers without the 2/3 adjustment


class Model(HybridModel):
    final_norm_name = "embedding_norm"

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.hidden_size, self.args.norm_eps)

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        args = self.args
        if layer_idx < args.num_dense_layers:
            ffn = GatedMLP(args.hidden_size, args.dense_ffn_size(), names=("w1", "w3", "w2"))
        else:
            ffn = SigmoidBiasMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                                 args.moe_intermediate_size, args.norm_topk_prob, args.routed_scaling_factor,
                                 args.use_expert_bias)
        return lfm2_layer(args, layer_type, ffn, self.make_norm)
