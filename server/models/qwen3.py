"""Qwen3 dense: Llama plus per-head q/k RMSNorm before RoPE and an explicit head_dim."""

from __future__ import annotations

from dataclasses import dataclass

from server.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen3"
    head_dim: int | None = 128


class Model(llama.Model):
    qk_norm = True
