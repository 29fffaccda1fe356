"""FP8 weights in the model: every linear and expert weight stored as float8_e4m3fn with one float32 scale
per output row; embeddings, norms and routers stay in the model dtype.

One swap (`swap_to_fp8`) replaces the modules, two ways: on the meta device, so that each checkpoint tensor
is quantized as it streams in (peak memory near the quantized size); or on a materialized model, quantizing
the weights it holds (`quantize_model`).
"""

from __future__ import annotations

import torch
from torch import nn

from server.kernels.fp8 import FP8_DTYPE, Fp8Linear, quantize_fp8_rowwise
from server.kernels.moe_fp8 import moe_experts_fp8, quantize_experts
from server.kernels.plan import StepPlan
from server.models.layers import FusedExperts, MergedLinear

ROUTER_NAMES = ("gate", "shared_expert_gate")  # MoE routers stay in the model dtype


class LoadableFp8Linear(Fp8Linear):
    """Fp8Linear the weight loader fills one checkpoint tensor (or row block of a fused weight) at a time."""

    checkpoint_buffers = ("weight",)

    @classmethod
    def like(cls, linear: nn.Linear, dtype: torch.dtype) -> LoadableFp8Linear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, linear.weight.device)

    def load_weight(self, leaf: str, index, tensor: torch.Tensor) -> None:
        """Quantize a checkpoint weight (or the row block `index` of a fused one) into place; `leaf` is "weight",
        the only tensor this layer declares to the loader."""
        self.load_rows(index if isinstance(index, slice) else slice(0, self.out_features), tensor)


class Fp8MergedLinear(LoadableFp8Linear):
    """Fp8Linear that keeps MergedLinear's fusion table, so the loader fills it one checkpoint tensor at a time."""

    def __init__(self, merged: MergedLinear, dtype: torch.dtype):
        super().__init__(merged.in_features, merged.out_features, merged.bias is not None, dtype, merged.weight.device)
        self.output_sizes, self.source_names = merged.output_sizes, merged.source_names

    shard_rows = MergedLinear.shard_rows


class Fp8FusedExperts(nn.Module):
    """FusedExperts with FP8 weights: gate_up_proj [E, 2I, H] + gate_up_scale [E, 2I], down_proj [E, H, I] + down_scale [E, H]."""

    checkpoint_buffers = ("gate_up_proj", "down_proj")

    def __init__(self, experts: FusedExperts):
        super().__init__()
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.per_expert_names, self.shared_slot = experts.per_expert_names, experts.shared_slot
        device = experts.gate_up_proj.device
        self.register_buffer("gate_up_proj", torch.empty(experts.gate_up_proj.shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer("gate_up_scale", torch.ones(experts.gate_up_proj.shape[:2], device=device))
        self.register_buffer("down_proj", torch.empty(experts.down_proj.shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer("down_scale", torch.ones(experts.down_proj.shape[:2], device=device))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        return moe_experts_fp8(
            x, weights, expert_ids, self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale, plan
        )

    def copy_from(self, experts: FusedExperts) -> None:
        self.load_weight("gate_up_proj", None, experts.gate_up_proj)
        self.load_weight("down_proj", None, experts.down_proj)

    @torch.no_grad()
    def load_weight(self, leaf: str, index, tensor: torch.Tensor) -> None:
        """Quantize a checkpoint tensor (one expert's rows, or several experts) into `leaf`[index]."""
        scale = self.gate_up_scale if leaf == "gate_up_proj" else self.down_scale
        target = getattr(self, leaf)
        tensor = tensor.to(target.device)
        if tensor.dim() == 3:  # experts fused: all of them (index None), or the routed ones beside a shared slot
            quantized, row_scale = quantize_experts(tensor)
            rows = slice(None) if index is None else index
            target[rows].copy_(quantized)
            scale[rows].copy_(row_scale)
            return
        quantized, row_scale = quantize_fp8_rowwise(tensor)
        target[index].copy_(quantized)
        scale[index].copy_(row_scale.squeeze(-1))


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every projection FP8 applies to: not routers, not an LM head tied to the embedding."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    found = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf not in ROUTER_NAMES and not (tied and leaf == "lm_head"):
            found[name] = module
    return found


def swap_to_fp8(model: nn.Module, dtype: torch.dtype, copy_weights: bool = False) -> None:
    """Replace the quantizable linears and the experts by their FP8 forms, in place. With
    `copy_weights`, each FP8 module quantizes the weights of the one it replaces (one layer at a time);
    without, the loader fills it later."""
    names = list(quantizable_linears(model))
    names += [name for name, module in model.named_modules() if isinstance(module, FusedExperts)]
    for name in names:
        module = model.get_submodule(name)
        fp8 = _fp8_form(module, dtype)
        if copy_weights:
            fp8.copy_from(module)
        _replace(model, name, fp8)


@torch.no_grad()
def quantize_model(model: nn.Module) -> nn.Module:
    """Convert a materialized model to FP8 in place."""
    swap_to_fp8(model, next(model.parameters()).dtype, copy_weights=True)
    return model


def _fp8_form(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    if isinstance(module, FusedExperts):
        return Fp8FusedExperts(module)
    if isinstance(module, MergedLinear):
        return Fp8MergedLinear(module, dtype)
    return LoadableFp8Linear.like(module, dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)
