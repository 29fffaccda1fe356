"""MoE experts with FP8 weights (one float32 scale per output row of each expert).

Fast path (the probe finds `scaled_grouped_mm` row-wise): the tokens are quantized once, before they are
gathered k times, so the k copies share one quantization; the SwiGLU output is quantized once more for `down`.
Fallback: dequantize only what the step needs — the chosen experts' weights when there are at most E slots,
all experts otherwise — and reuse the model-dtype paths of moe.py. It moves more bytes than FP8 saves; it exists
for devices without an FP8 grouped kernel (CPU), not for speed.
"""

from __future__ import annotations

import torch

from server.kernels import compat
from server.kernels.capabilities import with_fallback
from server.kernels.fp8 import FP8_DTYPE, fp8_cast, quantize_activation, quantize_fp8_rowwise
from server.kernels.moe import (
    combine_slots,
    moe_experts,
    slot_matvecs,
    slot_swiglu,
    sort_by_expert,
    swiglu,
    token_slots,
    use_gather_reduce,
)
from server.kernels.plan import StepPlan


def moe_experts_fp8(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] int64
    gate_up_q: torch.Tensor,  # [E, 2I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, 2I] float32
    down_q: torch.Tensor,  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, H] float32
    plan: StepPlan,
) -> torch.Tensor:
    """Same function as moe.moe_experts with gate_up = gate_up_q * scale[..., None], down likewise -> [T, H]."""
    if use_gather_reduce(plan, expert_ids, gate_up_q.shape[0]):
        return _experts_gather_reduce_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale)
    quantized = (gate_up_q, gate_up_scale, down_q, down_scale)
    if plan.fp8_grouped:
        return with_fallback(
            x.device, "fp8_grouped", lambda: _experts_scaled_grouped(x, weights, expert_ids, *quantized, plan.private_ops),
            lambda: _experts_dequantized(x, weights, expert_ids, *quantized, plan), plan.catch_fast_path_failures)
    return _experts_dequantized(x, weights, expert_ids, *quantized, plan)


def _experts_dequantized(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale, plan):
    """Without an FP8 grouped kernel: the chosen experts dequantized (few slots), else all of them."""
    opaque = plan.opaque_fp8_casts
    if expert_ids.numel() <= gate_up_q.shape[0]:
        return _experts_gathered_dequant(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale, opaque)
    gate_up = dequantize_experts(gate_up_q, gate_up_scale, x.dtype, opaque)
    return moe_experts(x, weights, expert_ids, gate_up, dequantize_experts(down_q, down_scale, x.dtype, opaque), plan)


def dequantize_experts(weight_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, opaque_cast: bool = False
                       ) -> torch.Tensor:
    """[E, N, K] fp8 with [E, N] scales -> [E, N, K] in dtype. `opaque_cast`: StepPlan.opaque_fp8_casts."""
    return (fp8_cast(weight_q, torch.float32, opaque_cast) * scale.unsqueeze(-1)).to(dtype)


def _gather_fp8(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """index_select on the raw bytes: not every backend has float8 gather kernels."""
    return tensor.view(torch.uint8).index_select(0, index).view(tensor.dtype)


def _experts_scaled_grouped(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale, private: bool):
    top_k = expert_ids.shape[1]
    order, offs = sort_by_expert(expert_ids, gate_up_q.shape[0])
    token_idx = order // top_k  # [T*k]
    x_fp8, x_scale = quantize_activation(x)  # [T, H], [T, 1]: once per token, shared by its k slots
    x_sorted = _gather_fp8(x_fp8, token_idx)
    scale_sorted = x_scale.view(-1).index_select(0, token_idx)  # [T*k]
    hidden = compat.scaled_grouped_mm_rowwise(
        x_sorted, gate_up_q.transpose(-2, -1), scale_sorted, gate_up_scale, offs, x.dtype, private
    )  # [T*k, 2I]
    act_fp8, act_scale = quantize_activation(swiglu(hidden))  # [T*k, I], [T*k, 1]
    y_sorted = compat.scaled_grouped_mm_rowwise(
        act_fp8, down_q.transpose(-2, -1), act_scale.view(-1), down_scale, offs, x.dtype, private
    )  # [T*k, H]
    return combine_slots(y_sorted, order, weights).to(x.dtype)


def _experts_gather_reduce_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale):
    """For torch.compile only (see moe._experts_gather_reduce): FP8 bytes read once, activations never
    quantized; each row scale applied after its reduction. The down is reduced per slot (the scale its
    epilogue, not a load per element), then weighted over the k slots as k pointwise terms that inductor fuses
    into the consumer (the residual add): one reduction over (slot, i) reads FP8 rows slower."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = slot_swiglu(gate_up_q, flat_ids, token_slots(x, top_k).unsqueeze(1), gate_up_scale)  # [T*k, I]
    y_slots = (down_q[flat_ids].float() * act.unsqueeze(1)).sum(-1) * down_scale[flat_ids]  # [T*k, H]
    y_slots = y_slots.view(num_tokens, top_k, -1)
    terms = [y_slots[:, j] * weights[:, j, None].float() for j in range(top_k)]  # [T, H] each
    return sum(terms[1:], terms[0]).to(x.dtype)


def _experts_gathered_dequant(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale, opaque: bool):
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    gate_up = dequantize_experts(_gather_fp8(gate_up_q, flat_ids), gate_up_scale.index_select(0, flat_ids), x.dtype,
                                 opaque)
    down = dequantize_experts(_gather_fp8(down_q, flat_ids), down_scale.index_select(0, flat_ids), x.dtype, opaque)
    return slot_matvecs(x, weights, gate_up, down)


def moe_experts_fp8_reference(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale):
    """Twin: loop over the experts hit, weights dequantized to float32, activations unquantized."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for expert in expert_ids.unique().tolist():
        token_idx, slot_idx = (expert_ids == expert).nonzero(as_tuple=True)
        gate_up = gate_up_q[expert].float() * gate_up_scale[expert].unsqueeze(-1)  # [2I, H]
        down = down_q[expert].float() * down_scale[expert].unsqueeze(-1)  # [H, I]
        y = swiglu(x[token_idx].float() @ gate_up.t()) @ down.t()  # [n, H]
        out.index_add_(0, token_idx, y * weights[token_idx, slot_idx, None].float())
    return out.to(x.dtype)


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], scale [E, N] float32), one expert at a time to bound the float32 copy."""
    weight_q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):
        weight_q[expert], expert_scale = quantize_fp8_rowwise(weight[expert])
        scale[expert] = expert_scale.squeeze(-1)
    return weight_q, scale
