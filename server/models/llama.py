"""Llama (incl. Llama-3 rope scaling). Also the base decoder that Qwen3 and Qwen3-MoE specialize."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from server.models.base import ATTENTION, BaseModelArgs
from server.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias or self.mlp_bias:
            raise ValueError("attention_bias / mlp_bias checkpoints are not supported yet")


class Model(CausalLM):
    """Llama: every layer attention + SwiGLU MLP, plain RMSNorm."""

    qk_norm = False

    def __init__(self, args: ModelArgs):
        super().__init__(args, [ATTENTION] * args.num_hidden_layers)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.hidden_size, self.args.rms_norm_eps)

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        args = self.args
        attention = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            qk_norm_eps=args.rms_norm_eps if self.qk_norm else None,
        )
        names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        return DecoderLayer(names, attention, self.make_mlp(layer_idx), self.make_norm)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return GatedMLP(self.args.hidden_size, self.args.intermediate_size)
