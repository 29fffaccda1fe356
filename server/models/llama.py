"""Llama (incl. Llama-3 rope scaling). Also the base decoder that Qwen3 and Qwen3-MoE specialize."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from server.models.base import AttentionMetadata, BaseModelArgs, CausalLM
from server.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding


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


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, mlp: nn.Module, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            qk_norm_eps=args.rms_norm_eps if qk_norm else None,
        )
        self.mlp = mlp

    def forward(self, x, rope, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """`model.*` in HF naming: embed_tokens, layers, norm."""

    def __init__(self, args: ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    """Decoder-only LM over the paged KV cache: forward() returns hidden states, compute_logits() the logits."""

    qk_norm = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        layers = [DecoderLayer(args, i, self.make_mlp(args, i), self.qk_norm) for i in range(args.num_hidden_layers)]
        self.model = DecoderBody(args, layers)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope_parameters)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()


    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return GatedMLP(args.hidden_size, args.intermediate_size)

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer's KV cache, in layer order."""
        return [(self.args.num_key_value_heads, self.args.head_dim)] * self.args.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per attention layer: [num_blocks, block_size, 2, kv_heads, head_dim]
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, rope, meta, kv_cache)
        return self.model.norm(x)  # [num_tokens, hidden]
