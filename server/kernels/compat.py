"""Version- and device-tolerant entry points: the matmuls the fast paths use, and a device synchronize.

torch 2.11+ exposes the public `F.scaled_mm` / `F.grouped_mm` / `F.scaled_grouped_mm`; some builds only have the
private `torch._scaled_mm` / `torch._grouped_mm` / `torch._scaled_grouped_mm`. Eager calls prefer the public op;
traced calls prefer the private aten op where it exists, because dynamo in torch 2.11 refuses to trace
`F.scaled_grouped_mm` ("function marked as skipped") while aten ops always trace. The probe runs both
spellings, so neither choice goes untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake as _is_fake

from server.kernels import devices


def _private(name: str, private: bool) -> bool:
    """Whether to call torch.<name> instead of the public F op: where asked (StepPlan.private_ops, the probe) and it
    exists, or where only it exists."""
    if not hasattr(torch, name):
        return False
    return private or not hasattr(F, name.lstrip("_"))


def grouped_mm(mat_a, mat_b, offs, out_dtype=None, private: bool = False) -> torch.Tensor:
    """[sum M, K] x [G, K, N] with int32 group ends `offs` [G] -> [sum M, N]."""
    if _private("_grouped_mm", private):
        return torch._grouped_mm(mat_a, mat_b, offs=offs, out_dtype=out_dtype)
    return F.grouped_mm(mat_a, mat_b, offs=offs, out_dtype=out_dtype)


def scaled_mm_rowwise(
    a_fp8: torch.Tensor,  # [M, K] float8_e4m3fn, row-major
    b_fp8: torch.Tensor,  # [K, N] float8_e4m3fn, column-major (a transposed [N, K] weight)
    scale_a: torch.Tensor,  # [M, 1] float32
    scale_b: torch.Tensor,  # [1, N] float32
    bias: torch.Tensor | None,  # [N] in out_dtype
    out_dtype: torch.dtype,
    private: bool = False,
) -> torch.Tensor:
    if _private("_scaled_mm", private):
        return torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    rowwise = F.ScalingType.RowWise
    return F.scaled_mm(a_fp8, b_fp8, scale_a, rowwise, scale_b, rowwise, bias=bias, output_dtype=out_dtype)


def scaled_grouped_mm_rowwise(
    a_fp8: torch.Tensor,  # [sum M, K] float8_e4m3fn
    b_fp8: torch.Tensor,  # [G, K, N] float8_e4m3fn, a transposed view of [G, N, K]
    scale_a: torch.Tensor,  # [sum M] float32
    scale_b: torch.Tensor,  # [G, N] float32
    offs: torch.Tensor,  # [G] int32 group ends
    out_dtype: torch.dtype,
    private: bool = False,
) -> torch.Tensor:
    if _private("_scaled_grouped_mm", private):
        return torch._scaled_grouped_mm(a_fp8, b_fp8, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
    rowwise = F.ScalingType.RowWise
    return F.scaled_grouped_mm(a_fp8, b_fp8, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=out_dtype)


def spellings(public: str) -> list[tuple[str, bool]]:
    """The (name, private flag) pairs this torch build has for an op, for the probe to run each."""
    found = [(f"F.{public}", False)] if hasattr(F, public) else []
    return found + ([(f"torch._{public}", True)] if hasattr(torch, f"_{public}") else [])


def synchronize(device: torch.device | str) -> None:
    """Block the host until the device has finished its queued work (nothing to wait for on the CPU)."""
    if devices.is_host(device):
        return
    module = devices.device_module(device)
    if module is torch.cuda:
        module.synchronize(device)
    else:
        module.synchronize()


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a FakeTensor: a shape without memory, as the compile child's twin has."""
    return _is_fake(tensor)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def compile_region(fn):
    """`torch.compiler.nested_compile_region(fn)` where torch traces nested regions with the caller's dynamic
    sizes (2.13+); older releases turn every dynamic size inside the region into an unbacked one, on which a
    layer's shape-dependent branches cannot be traced, so there `fn` is compiled inline, as one graph."""
    return torch.compiler.nested_compile_region(fn) if regions_compile_once() else fn


def inline_regions_pass():
    """torch's pass that inlines every compiled-region call of a traced graph back into it (2.13+), or None."""
    try:
        from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph
    except ImportError:
        return None
    return inline_invoke_subgraph


def regions_inline_after_tracing() -> bool:
    """Whether a step built with inductor's C++ wrapper (compile.knobs.cpp_wrapper_inductor) may call compiled regions (traced once, then inlined)."""
    return regions_compile_once() and inline_regions_pass() is not None


def regions_compile_once() -> bool:
    """Whether compile_region compiles its function once for every call site (else once per call, inline)."""
    return torch_version() >= (2, 13) and hasattr(torch.compiler, "nested_compile_region")
