"""Process-wide settings of torch.compile and inductor that the compile wing owns: which generated kernels are
tuned, whether compiled calls run while another thread traces, and inductor with its C++ wrapper."""

from __future__ import annotations

import torch

from server.kernels import compat, devices
from server.kernels.fp8 import has_fp8_linears
from server.models.affine_quant import affine_modules


def tune_generated_kernels(device: torch.device, packed_weights: bool) -> None:
    """On CUDA, for a model with FP8 linears or packed int4 / int8 weights, inductor tunes each generated Triton
    kernel's block sizes (coordinate descent) at its first run, for every compile of this process from now on: its
    default blocks for a reduction over 1-byte FP8 rows leave about half the bandwidth unused. A model without
    them keeps the defaults: the tuning also turns its one-token matmuls into reductions, for more kernels per
    layer and no measured gain. Metal and C++ kernels have no such tuner. A compile child sets the same: the
    setting is part of inductor's cache key."""
    if devices.tunes_generated_kernels(device):
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = packed_weights


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


def cpp_wrapper_inductor(gm, example_inputs):
    """A torch.compile backend: inductor with its C++ wrapper, which cannot call a compiled region, given the
    traced graph with every region inlined. Dynamo still traces each distinct region once and stamps it out for
    the other layers (where torch has the pass), so only inductor sees every layer."""
    from torch._inductor.compile_fx import compile_fx

    inline = compat.inline_regions_pass()
    return compile_fx(inline(gm) if inline else gm, example_inputs, config_patches={"cpp_wrapper": True})


def cpp_wrapper_compile_kwargs() -> dict:
    """torch.compile's arguments for inductor with its C++ wrapper: inductor's own option where no compiled region
    is to be inlined first (torch 2.11 saves no compile made through a backend of ours), else
    cpp_wrapper_inductor."""
    return {"backend": cpp_wrapper_inductor} if compat.regions_inline_after_tracing() else {"options": {"cpp_wrapper": True}}


def has_packed_weights(model: torch.nn.Module) -> bool:
    """Whether `model` reads FP8 or packed int4 / int8 weights (tune_generated_kernels)."""
    return has_fp8_linears(model) or bool(affine_modules(model))
