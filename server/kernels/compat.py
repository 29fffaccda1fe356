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
    """Whether a step built by cpp_wrapper_inductor may call compiled regions (traced once, then inlined)."""
    return regions_compile_once() and inline_regions_pass() is not None


def cpp_wrapper_inductor(gm, example_inputs):
    """A torch.compile backend: inductor with its C++ wrapper, which cannot call a compiled region, given the
    traced graph with every region inlined. Dynamo still traces each distinct region once and stamps it out for
    the other layers (where torch has the pass), so only inductor sees every layer."""
    from torch._inductor.compile_fx import compile_fx

    inline = inline_regions_pass()
    return compile_fx(inline(gm) if inline else gm, example_inputs, config_patches={"cpp_wrapper": True})


def cpp_wrapper_compile_kwargs() -> dict:
    """torch.compile's arguments for inductor with its C++ wrapper: inductor's own option where no compiled region
    is to be inlined first (torch 2.11 saves no compile made through a backend of ours), else
    cpp_wrapper_inductor."""
    return {"backend": cpp_wrapper_inductor} if regions_inline_after_tracing() else {"options": {"cpp_wrapper": True}}


def regions_compile_once() -> bool:
    """Whether compile_region compiles its function once for every call site (else once per call, inline)."""
    return torch_version() >= (2, 13) and hasattr(torch.compiler, "nested_compile_region")


def run_compiled_calls_during_fx_tracing() -> None:
    """FX's "tracing now" flag is process-wide: while a compile on one thread traces (inductor's pattern matcher
    does, through make_fx), a compiled step called on another thread would refuse to run ("FX to symbolically
    trace a dynamo-optimized function"). Compiled calls run regardless where torch lets them (force_compile_*),
    else they run their eager code for that call. Set for the calling thread only (torch's compile settings are
    per thread from 2.13 on): call it on the thread that serves."""
    config = torch._dynamo.config
    if hasattr(config, "force_compile_during_fx_trace"):
        config.force_compile_during_fx_trace = True
    else:
        config.error_on_nested_fx_trace = False


def tune_generated_kernels(device: torch.device, fp8_weights: bool) -> None:
    """On CUDA, for a model with FP8 linears, inductor tunes each generated Triton kernel's block sizes (coordinate
    descent) at its first run, for every compile of this process from now on: its default blocks for a reduction
    over 1-byte FP8 rows leave about half the bandwidth unused. A model without them keeps the defaults: the tuning
    also turns its one-token matmuls into reductions, for more kernels per layer and no measured gain. Metal and
    C++ kernels have no such tuner. A compile child sets the same: the setting is part of inductor's cache key."""
    if devices.tunes_generated_kernels(device):
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = fp8_weights
