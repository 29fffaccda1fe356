"""A dense linear whose one-token product, in a compiled step, can be one reduction over K instead of a GEMM
library call.

At one token cuBLAS runs a linear with few outputs for its inputs (o_proj, down_proj: out <= in) as a split-K
GEMV plus a kernel that sums the splits; written as `(x * W).sum(-1)`, inductor lowers it to one reduction
kernel that reads W once (Triton on CUDA). Only where the decode step's kernels are launched one by one from the
host (CUDA without graphs), where every kernel costs host time; MPS's GEMV behind F.linear is one kernel already.
Eager, the product would materialize [M, N, K], so the form runs only under torch.compile.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


class RowReductionLinear(nn.Linear):
    """nn.Linear (same parameters and names) whose one-token product in a compiled step is one reduction where
    `reduces_one_token` is set (prefer_row_reduction)."""

    reduces_one_token = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.numel() // x.shape[-1]
        if self.reduces_one_token and torch.compiler.is_compiling() and isinstance(num_tokens, int) and num_tokens == 1:
            return row_reduction_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def row_reduction_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N] as one reduction over K, accumulated in float32 and
    rounded once to x.dtype (for torch.compile: see the module docstring)."""
    # as_strided makes inductor store x first: otherwise x's producer (silu(gate) * up, attention's combine) is
    # inlined into the reduction and recomputed for every output row
    x = x.as_strided(x.shape, x.stride())
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)  # [..., 1, K] * [N, K] -> [..., N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def reduces_one_token(device: torch.device, use_graphs: bool) -> bool:
    """Whether the decode step takes the row reduction for its one-token linears: where its kernels are launched
    one by one and the GEMM library splits K (CUDA). `MPS_SERVE_GEMV_AB` (blas, nographs, all) is the A/B switch of
    `benchmarks/h200_runs.sh gemvab`: it goes, with the losing form, once that has run on a GPU."""
    choice = os.environ.get("MPS_SERVE_GEMV_AB", "nographs")
    return device.type == "cuda" and (choice == "all" or (choice == "nographs" and not use_graphs))


def prefer_row_reduction(model: nn.Module, preferred: bool) -> None:
    """Set the one-token form of every RowReductionLinear in `model` with out_features <= in_features (the shapes
    the GEMM library splits K for)."""
    for module in model.modules():
        if isinstance(module, RowReductionLinear):
            module.reduces_one_token = preferred and module.out_features <= module.in_features
