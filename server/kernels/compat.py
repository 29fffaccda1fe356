"""Version-tolerant entry points for the matmuls the fast paths use.

torch 2.11+ exposes the public `F.scaled_mm` / `F.grouped_mm` / `F.scaled_grouped_mm`; some builds only have the
private `torch._scaled_mm` / `torch._grouped_mm` / `torch._scaled_grouped_mm`. Each wrapper prefers the public op
and falls back to the private one, so callers (and the capability probe) never look at version numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None = None):
    """[sum M, K] x [G, K, N] with int32 group ends `offs` [G] -> [sum M, N]."""
    public = getattr(F, "grouped_mm", None)
    if public is not None:
        return public(mat_a, mat_b, offs=offs, out_dtype=out_dtype)
    return torch._grouped_mm(mat_a, mat_b, offs=offs, out_dtype=out_dtype)


def scaled_mm_rowwise(
    a_fp8: torch.Tensor,  # [M, K] float8_e4m3fn, row-major
    b_fp8: torch.Tensor,  # [K, N] float8_e4m3fn, column-major (a transposed [N, K] weight)
    scale_a: torch.Tensor,  # [M, 1] float32
    scale_b: torch.Tensor,  # [1, N] float32
    bias: torch.Tensor | None,  # [N] in out_dtype
    out_dtype: torch.dtype,
) -> torch.Tensor:
    public = getattr(F, "scaled_mm", None)
    if public is not None:
        rowwise = F.ScalingType.RowWise
        return public(a_fp8, b_fp8, scale_a, rowwise, scale_b, rowwise, bias=bias, output_dtype=out_dtype)
    return torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def scaled_mm_tensorwise(a_fp8, b_fp8, scale_a, scale_b, bias, out_dtype):
    """Same as scaled_mm_rowwise with 0-d float32 scales."""
    public = getattr(F, "scaled_mm", None)
    if public is not None:
        tensorwise = F.ScalingType.TensorWise
        return public(a_fp8, b_fp8, scale_a, tensorwise, scale_b, tensorwise, bias=bias, output_dtype=out_dtype)
    return torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def scaled_grouped_mm_rowwise(
    a_fp8: torch.Tensor,  # [sum M, K] float8_e4m3fn
    b_fp8: torch.Tensor,  # [G, K, N] float8_e4m3fn, a transposed view of [G, N, K]
    scale_a: torch.Tensor,  # [sum M] float32
    scale_b: torch.Tensor,  # [G, N] float32
    offs: torch.Tensor,  # [G] int32 group ends
    out_dtype: torch.dtype,
) -> torch.Tensor:
    public = getattr(F, "scaled_grouped_mm", None)
    if public is not None:
        rowwise = F.ScalingType.RowWise
        return public(a_fp8, b_fp8, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=out_dtype)
    return torch._scaled_grouped_mm(a_fp8, b_fp8, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
