"""LFM2 dense: short-conv and attention operators, dense SwiGLU FFN (w1/w3/w2), tied embeddings.

Per layer `h = x + op(operator_norm(x)); x = h + feed_forward(ffn_norm(h))`; the final norm is
`model.embedding_norm`. All norms are plain RMSNorm (eps `norm_eps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from server.models.base import ATTENTION, BaseModelArgs
from server.models.hybrid import HybridModel, lfm2_layer
from server.models.layers import GatedMLP, RMSNorm


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "lfm2"
    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    max_position_embeddings: int = 128000
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]):
        config = dict(config)
        # Names used by the original LFM2 checkpoints, as transformers maps them.
        if "tie_embedding" in config:
            config["tie_word_embeddings"] = config.pop("tie_embedding")
        if "block_ff_dim" in config:
            config["intermediate_size"] = config.pop("block_ff_dim")
        return super().from_hf_config(config)

    def __post_init__(self) -> None:
        self.rope_parameters = {"rope_theta": 1e6, **self.rope_parameters}
        if self.conv_bias:
            raise ValueError("LFM2 checkpoints with conv_bias=true are not supported")
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()

    def default_layer_types(self) -> list[str]:
        """transformers' rule: `full_attn_idxs` (all layers when absent) are attention, the rest conv."""
        idxs = self.full_attn_idxs if self.full_attn_idxs is not None else range(self.num_hidden_layers)
        return [ATTENTION if i in idxs else "conv" for i in range(self.num_hidden_layers)]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def dense_ffn_size(self) -> int:
        """`block_auto_adjust_ff_dim`: int(2/3 ff), times the multiplier, rounded up to block_multiple_of."""
        size = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            size = int(2 * size / 3)
            if self.block_ffn_dim_multiplier is not None:
                size = int(self.block_ffn_dim_multiplier * size)
                size = self.block_multiple_of * -(-size // self.block_multiple_of)
        return size


class Model(HybridModel):
    final_norm_name = "embedding_norm"

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.hidden_size, self.args.norm_eps)

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        ffn = GatedMLP(self.args.hidden_size, self.args.dense_ffn_size(), names=("w1", "w3", "w2"))
        return lfm2_layer(self.args, layer_type, ffn, self.make_norm)
