"""Dense decode linear: `F.linear` on contiguous [B, 1, H] input with the bias fused; and, as an opt-in A/B form,
the one-token GEMV written as a multiply-and-sum for inductor to lower to one reduction kernel.

`F.linear(x, w, b)` on a 3-D input reaches the GEMV kernels (2.15 MPS; cuBLAS on CUDA) and adds the bias in the
same call; a matmul followed by a separate add, or a reshape that copies, costs an extra pass per layer.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, S, K] (decode: S = 1), weight [N, K], bias [N] -> [B, S, N]."""
    return F.linear(x.contiguous(), weight, bias)  # contiguous() is free when x already is


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: float32 matmul, then the bias, rounded once to x.dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class ReductionGemv:
    """Mixin for an nn.Linear: inside a compiled graph with exactly one token (a static size: the batch-1 decode
    graph), the product is `(x * W).sum(-1)`, which inductor lowers to one Triton reduction kernel that streams W
    once. Everywhere else (eager, symbolic token counts, prefill) it is `F.linear`; eagerly the product form would
    materialize [N, K]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.numel() // x.shape[-1]
        if torch.compiler.is_compiling() and isinstance(num_tokens, int) and num_tokens == 1:
            # as_strided makes inductor store x first: otherwise x's producer (silu(gate) * up, flex attention's
            # combine) is inlined into the reduction and recomputed for every output row (H200: down 62.5 us
            # instead of 28.5; only the CPU backend realizes such inputs on its own)
            x = x.as_strided(x.shape, x.stride())
            out = (x.unsqueeze(-2) * self.weight).sum(-1)  # [..., 1, K] * [N, K] -> [..., N], fp32 accumulation
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


@functools.cache
def _reduction_class(cls: type) -> type:
    return type(f"ReductionGemv{cls.__name__}", (ReductionGemv, cls), {})


def use_reduction_gemv(model: nn.Module) -> list[str]:
    """Give the one-token reduction form to every dense linear with out_features <= in_features (alone, that form
    beat cuBLAS on the H200 only for those shapes; qkv and gate_up were faster in cuBLAS). Returns the module names.
    Parameter names and values are untouched."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, ReductionGemv) and module.out_features <= module.in_features:
            module.__class__ = _reduction_class(type(module))
            names.append(name)
    return names
