"""Prefill and mixed steps compiled with dynamic shapes (EngineConfig.compile_prefill)."""

from __future__ import annotations

import torch
import torch.fx.experimental._config as shape_config
from torch import nn

from server.kernels.plan import StepPlan


class CompiledPrefill:
    """Prefill and mixed steps through torch.compile(dynamic=True) (EngineConfig.compile_prefill): one graph per
    attention form instead of one per shape. Token, sequence and block counts vary freely; the caches never
    change shape, so they are static (else torch's duck sizing equates e.g. a batch of 8 with 8 KV heads and
    recompiles when they differ), and sizes 0/1 are not specialized (one graph serves one sequence or many; not
    for hybrids, see below)."""

    def __init__(self, model: nn.Module, cache_tensors: list[torch.Tensor], plan: StepPlan, size_oblivious: bool = True):
        self.plan = plan  # the compiled plan: the same object every call, so dynamo's guards on it always pass
        for tensor in cache_tensors:
            torch._dynamo.mark_static(tensor)
        self._compiled = torch.compile(model, dynamic=True)
        # Hybrids specialize size 1: with it size-oblivious, the Gated DeltaNet chunked prefill fails to trace or
        # lower (a state broadcast, a `[-1:]` slice, solve_triangular's fake strides).
        wanted = {"use_duck_shape": False, "backed_size_oblivious": size_oblivious}  # private knobs, where present
        self._shape_config = {k: v for k, v in wanted.items() if hasattr(shape_config, k)}
        # attention forms x MoE token-count paths: a few graphs of one forward, within dynamo's limit
        self._recompile_limit = max(torch._dynamo.config.recompile_limit, 16)

    def __call__(self, *args):
        # Set per call, in the calling thread: torch's compile settings are per thread (2.13+), and the
        # background compile, the engine thread and the caller each compile on their own thread.
        with shape_config.patch(**self._shape_config), torch._dynamo.config.patch(
                recompile_limit=self._recompile_limit):
            return self._compiled(*args, self.plan)
