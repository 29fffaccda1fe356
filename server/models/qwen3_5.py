"""Qwen3.5 dense text model (`qwen3_5` / `qwen3_5_text`): Gated DeltaNet layers, gated attention every
`full_attention_interval`-th layer, zero-centred RMSNorm everywhere, dense SwiGLU MLP.

The checkpoint is the text part of `Qwen3_5ForConditionalGeneration`: the config nests `text_config`, and
weights sit under `model.language_model.` beside `model.visual.*` and `mtp.*`, which are skipped.
Qwen3.5's "interleaved mRoPE" equals 1-D partial RoPE for text (all three position streams are equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from server.models.base import BaseModelArgs
from server.models.hybrid import HybridModel, default_layer_types, gated_hybrid_layer
from server.models.layers import GatedMLP


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen3_5_text"
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    hidden_act: str = "silu"
    attention_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]):
        """A nested `text_config` (the multimodal checkpoint) is the model; its keys win over the top level."""
        config = dict(config)
        text = config.pop("text_config", None)
        if text:
            config.pop("model_type", None)
            config.update(text)
        return super().from_hf_config(config)

    def __post_init__(self) -> None:
        self.rope_parameters = {"partial_rotary_factor": 0.25, **self.rope_parameters}
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers, self.full_attention_interval)
        if self.hidden_act != "silu" or self.attention_bias:
            raise ValueError("only hidden_act=silu without attention biases is supported for Qwen3.5 / Qwen3-Next")


class Model(HybridModel):
    ignored_prefixes = ("model.visual.", "mtp.")
    zero_centered_norms = True

    def make_layer(self, layer_idx: int, layer_type: str) -> nn.Module:
        mlp = GatedMLP(self.args.hidden_size, self.args.intermediate_size)
        return gated_hybrid_layer(self.args, layer_type, mlp, self.make_norm)
