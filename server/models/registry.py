"""model_type -> architecture module. Each module exports ModelArgs and Model."""

from __future__ import annotations

import importlib
from types import ModuleType

# model_type (config.json) -> module under server.models
MODEL_MODULES: dict[str, str] = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    # Hybrids (short-conv / Gated DeltaNet state layers); the `*_text` types are the nested text configs.
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}


def get_model_module(model_type: str) -> ModuleType:
    if model_type not in MODEL_MODULES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_MODULES))}"
        )
    return importlib.import_module(f"server.models.{MODEL_MODULES[model_type]}")
