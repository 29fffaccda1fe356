"""Embeddings of sentence-transformers checkpoints (e.g. Qwen3-Embedding): the decoder's final hidden states
(after the final norm), pooled and normalized as the checkpoint's `modules.json` and pooling config say.

A checkpoint is an embedding model when `modules.json` lists a Pooling module; `Normalize` in that list turns on
L2 normalization. The forward is one whole-sequence prefill that attends over its own K/V only, so it leaves the
serving KV cache untouched and runs between two engine steps (so a long input delays running streams by its
whole forward: it is not chunked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from server.engine.device import serialized_device_work
from server.engine.types import InvalidRequestError, ModelLoadError
from server.kernels.paged_attention import prefill_sdpa_backends
from server.kernels.plan import StepPlan
from server.models.base import ATTENTION, AttentionMetadata

MODULES_FILE = "modules.json"
# sentence-transformers pooling config key -> pooling mode
_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # "last" | "mean" | "first"
    normalize: bool


def read_pooling(model_dir: Path) -> Pooling | None:
    """The checkpoint's pooling (sentence-transformers layout), or None when it is no embedding model."""
    modules_path = model_dir / MODULES_FILE
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text())
        pool = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pool is None:
            return None
        config = json.loads((model_dir / pool.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{modules_path} or its pooling config could not be read: {exc}") from exc
    modes = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ModelLoadError(f"{model_dir}: pooling config {config} asks for {modes or 'no'} supported pooling modes "
                             f"(one of {sorted(_POOLING_MODES)} is supported)")
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    return Pooling(modes[0], normalize)


def check_embeddable(model: torch.nn.Module) -> None:
    """The pooled forward serves pure-attention decoders (state layers need the engine's state slots)."""
    if set(model.model.layer_types) != {ATTENTION}:
        raise ModelLoadError("embeddings are supported for attention-only architectures (e.g. qwen3, llama)")


@torch.inference_mode()
def hidden_states(model: torch.nn.Module, token_ids: list[int], device: torch.device, plan: StepPlan) -> torch.Tensor:
    """Final hidden states `[num_tokens, hidden]` of one sequence, attending over its own K/V only. The K/V
    written on the way goes to a scratch block that every layer of one shape reuses."""
    num_tokens = len(token_ids)
    positions = torch.arange(num_tokens, device=device)
    zeros = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions, block_tables=torch.zeros(1, 1, dtype=torch.int64, device=device),
        query_index=positions[None], query_positions=positions[None], token_rows=zeros, token_cols=positions,
        fresh_prefill=True,
    )
    embed = model.model.embed_tokens
    dtype = getattr(embed, "scales", embed.weight).dtype  # an affine-quantized table's weight is packed uint32
    scratch: dict[tuple[int, int], torch.Tensor] = {}
    caches = [
        scratch.setdefault(shape, torch.empty(1, num_tokens, 2, *shape, dtype=dtype, device=device))
        for shape in model.kv_cache_shapes()
    ]
    input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    with prefill_sdpa_backends(device):
        return model(input_ids, positions, meta, caches, plan)


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """`[num_tokens, hidden]` -> float32 `[hidden]`."""
    hidden = hidden.float()
    if pooling.mode == "last":
        vector = hidden[-1]
    elif pooling.mode == "mean":
        vector = hidden.mean(dim=0)
    else:
        vector = hidden[0]
    return F.normalize(vector, dim=-1) if pooling.normalize else vector


def truncate(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Matryoshka truncation to the first `dimensions` values, renormalized when the model normalizes."""
    if dimensions is None:
        return vector
    if not 1 <= dimensions <= len(vector):
        raise InvalidRequestError(f"dimensions must be between 1 and {len(vector)} for this model, got {dimensions}.",
                                  param="dimensions")
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = sum(v * v for v in head) ** 0.5 or 1.0
    return [v / norm for v in head]


def embed(model: torch.nn.Module, inputs, device: torch.device, plan: StepPlan, pooling: Pooling | None,
          model_name: str, prompts, dimensions: int | None = None) -> tuple[list[list[float]], int]:
    """Pooled embedding of each prompt (text or token ids; `inputs`: engine.inputs.Inputs), truncated to
    `dimensions` if given; -> (vectors, number of prompt tokens). Only for embedding checkpoints; runs while the
    engine is between steps."""
    if pooling is None:
        raise InvalidRequestError(
            f"the served model {model_name} is not an embedding model: its checkpoint has no "
            "sentence-transformers pooling config (modules.json and a Pooling module). Serve an embedding "
            "checkpoint such as Qwen3-Embedding.", param="model", code="model_not_embedding")
    vectors, num_tokens = [], 0
    for index, prompt in enumerate(prompts):
        ids = inputs.prompt_ids(prompt)
        if len(ids) > inputs.max_model_len:
            raise InvalidRequestError(
                f"input[{index}] is {len(ids)} tokens, more than this model's maximum context length of "
                f"{inputs.max_model_len} tokens.", param="input", code="context_length_exceeded")
        with serialized_device_work(device):
            vector = pool(hidden_states(model, ids, device, plan), pooling).tolist()
        vectors.append(truncate(vector, dimensions, pooling.normalize))
        num_tokens += len(ids)
    return vectors, num_tokens
