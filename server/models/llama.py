"""Llama (incl. Llama-3 rope scaling): every layer attention + SwiGLU MLP, plain RMSNorm. Its ModelArgs are the
base that Qwen3's and Qwen3-MoE's extend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from server.models.base import BaseModelArgs
from server.models.layers import CausalLM, GatedMLP, attention_decoder_layer


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
    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        mlp = GatedMLP(self.args.hidden_size, self.args.intermediate_size)
        return attention_decoder_layer(self.args, mlp, self.make_norm, qk_norm=False)
