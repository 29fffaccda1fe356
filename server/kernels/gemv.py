"""A dense linear whose one-token product, in a compiled step, is one reduction over K instead of a GEMM library
call.

At one token cuBLAS runs a linear with few outputs for its inputs (o_proj, down_proj: out <= in) as a split-K
GEMV plus a kernel that sums the splits; written as `(x * W).sum(-1)`, inductor lowers it to one reduction
kernel that reads W once (Triton on CUDA), faster end to end with and without CUDA graphs (docs/PERF.md).
MPS's GEMV behind F.linear is one kernel already, and keeps it. Eager, the product would materialize [M, N, K], so
the form runs only under torch.compile: the step plan says where (StepPlan.row_reduction_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels.plan import StepPlan


class RowReductionLinear(nn.Linear):
    """nn.Linear (same parameters and names) whose one-token product is one reduction where the plan says so
    (StepPlan.row_reduction_linear: compiled, where the device's GEMM library would split K) and out_features <=
    in_features (the shapes it splits)."""

    def forward(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        if plan.row_reduction_linear and self.out_features <= self.in_features:
            num_tokens = x.numel() // x.shape[-1]
            if isinstance(num_tokens, int) and num_tokens == 1:
                return row_reduction_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def row_reduction_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N] as one reduction over K, accumulated in float32 and
    rounded once to x.dtype (for torch.compile: see the module docstring)."""
    x = stored(x)  # else x's producer (silu(gate) * up, attention's combine) is recomputed for every output row
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)  # [..., 1, K] * [N, K] -> [..., N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def stored(tensor: torch.Tensor) -> torch.Tensor:
    """The same values; under torch.compile, inductor stores `tensor` in a buffer (an as_strided view is a
    realization point) instead of inlining its expression into every reader."""
    return tensor.as_strided(tensor.shape, tensor.stride())
