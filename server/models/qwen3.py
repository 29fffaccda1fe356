"""Qwen3 dense: Llama plus per-head q/k RMSNorm before RoPE and an explicit head_dim."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from server.models import llama
from server.models.layers import CausalLM, GatedMLP, attention_decoder_layer


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3"
    head_dim: int | None = 128


class Model(CausalLM):
    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        mlp = GatedMLP(self.args.hidden_size, self.args.intermediate_size)
        return attention_decoder_layer(self.args, mlp, self.make_norm, qk_norm=True)
