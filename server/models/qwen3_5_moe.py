"""Qwen3.5 / Qwen3.6 MoE (35B-A3B; `qwen3_5_moe` / `qwen3_5_moe_text`): the Qwen3.5 hybrid with an MoE in
every layer: softmax router (fp32, always renormalized) plus a sigmoid-gated shared expert. Checkpoints
store the experts fused (`experts.gate_up_proj` / `experts.down_proj`) or per expert; both load.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from server.models import qwen3_5
from server.models.hybrid import HybridModel, SharedExpertMoE, gated_hybrid_layer


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe_text"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8


class Model(HybridModel):
    ignored_prefixes = ("model.visual.", "mtp.")
    zero_centered_norms = True
    shared_expert_slots = True

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        args = self.args
        moe = SharedExpertMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                              args.moe_intermediate_size, args.shared_expert_intermediate_size, renormalize=True)
        return gated_hybrid_layer(args, layer_type, moe, self.make_norm)
