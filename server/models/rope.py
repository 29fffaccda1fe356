"""RoPE: the rope settings of a config.json, and the inverse frequencies and attention factor of every rope
type the models compute, as transformers computes them.

Types: "default"; "linear" (inv_freq / factor); "dynamic" (NTK: the base grows with the sequence length
beyond max_position_embeddings); "yarn" (low frequencies interpolated, high ones kept, a ramp
between, cos/sin scaled by the attention factor); "llama3" (yarn-like bands with a smooth blend). A rope
type or key outside these refuses to load: computing plain RoPE instead would give wrong logits silently.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# The keys each rope type reads besides COMMON_KEYS, and those of them a config must give.
ROPE_TYPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
REQUIRED_KEYS = {"linear": {"factor"}, "dynamic": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"}}
# mRoPE's sections pick the position stream (time, height, width) each frequency turns with; text positions are
# equal in every stream, so for text-only input mRoPE is plain RoPE and its keys change nothing.
COMMON_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """config.json's rope settings as one dict with its `rope_type` spelled out, standardized as transformers
    does. transformers 5 writes `rope_parameters`; older checkpoints carry rope_theta / rope_scaling (legacy
    `type`). Raises ValueError for a rope type or key the models do not compute."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and key in config:
            rope[key] = config[key]
    rope_type = rope.setdefault("rope_type", "default")
    check_rope_type(rope_type)
    unused = sorted(set(rope) - COMMON_KEYS - ROPE_TYPE_KEYS[rope_type])
    if unused:
        raise ValueError(f"rope_parameters {unused} are not supported with rope_type {rope_type!r}, which reads "
                         f"{sorted(COMMON_KEYS | ROPE_TYPE_KEYS[rope_type])}")
    missing = sorted(key for key in REQUIRED_KEYS.get(rope_type, ()) if rope.get(key) is None)
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters {missing}")
    if "original_max_position_embeddings" in ROPE_TYPE_KEYS[rope_type]:
        rope["original_max_position_embeddings"] = _original_max_len(config, rope)
    if rope_type == "yarn" and rope.get("factor") is None:  # DeepSeek-V3 style: the ratio of the two lengths
        rope["factor"] = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return rope


def _original_max_len(config: dict[str, Any], rope: dict[str, Any]) -> int:
    """The length the model was trained at, where transformers takes it: llama3 and yarn prefer a top-level
    value (Phi-3 style), then their own, then max_position_embeddings; dynamic NTK scales beyond
    max_position_embeddings and reads no other."""
    max_len = config.get("max_position_embeddings")
    if rope["rope_type"] == "dynamic":
        given = rope.get("original_max_position_embeddings", max_len)
        if given != max_len:
            raise ValueError(f"rope_type 'dynamic' scales beyond max_position_embeddings={max_len}, not "
                             f"original_max_position_embeddings={given}: set them equal or drop the latter")
    else:
        max_len = config.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_len))
    if max_len is None:
        raise ValueError(f"rope_type {rope['rope_type']!r} needs max_position_embeddings")
    return int(max_len)


def check_rope_type(rope_type: str) -> None:
    if rope_type not in ROPE_TYPE_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPE_KEYS)}")


def rope_inv_freq(
    head_dim: int, rope: dict[str, Any], device: torch.device | str = "cpu", seq_len: torch.Tensor | None = None
) -> torch.Tensor:
    """inv_freq of the rotated part of the head for `rope`'s type. `seq_len` (0-d: the longest sequence
    length of the forward) is read by "dynamic" only; without it, the frequencies up to its threshold."""
    rope_type = rope.get("rope_type", "default")
    check_rope_type(rope_type)
    theta = float(rope.get("rope_theta", 10000.0))
    rot_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim
    inv_freq = 1.0 / theta**exponents  # [rot_dim // 2]
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "dynamic" and seq_len is not None:
        # base * growth ** (d / (d - 2)), factored out of base ** -exponents: exact default RoPE at growth 1
        return inv_freq * _ntk_growth(rope, seq_len) ** (-exponents * rot_dim / (rot_dim - 2))
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, rope, rot_dim, theta)
    return inv_freq


def rope_attention_factor(rope: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: yarn's `attention_factor`, given or derived from `factor` (and
    `mscale` / `mscale_all_dim` when both are set); 1 for every other type."""
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _ntk_growth(rope: dict[str, Any], seq_len: torch.Tensor) -> torch.Tensor:
    """1 + factor * (seq_len - orig) / orig for seq_len beyond orig, else 1: transformers' `factor * seq_len /
    orig - (factor - 1)`, written so that it is exactly 1 at the threshold."""
    orig = int(rope["original_max_position_embeddings"])
    return 1.0 + float(rope["factor"]) * (seq_len.clamp(min=orig) - orig) / orig


def _llama3_scale(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    orig = float(rope["original_max_position_embeddings"])
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_scale(inv_freq: torch.Tensor, rope: dict[str, Any], rot_dim: int, theta: float) -> torch.Tensor:
    """Frequencies turning fewer than `beta_slow` times over the original length are interpolated (/ factor),
    those turning more than `beta_fast` times kept, with a linear ramp over the dims between."""
    factor = float(rope["factor"])
    orig = float(rope["original_max_position_embeddings"])

    def dim_of(num_rotations: float) -> float:
        return rot_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rope.get("beta_fast") or 32), dim_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    dims = torch.arange(rot_dim // 2, dtype=torch.float32, device=inv_freq.device)
    interpolated = ((dims - low) / (high - low)).clamp(0, 1)  # [rot_dim // 2]: 0 keeps, 1 interpolates
    return inv_freq / factor * interpolated + inv_freq * (1 - interpolated)
