"""The one-token row reduction of RowReductionLinear (CPU, inductor's C++ code)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from server.kernels import gemv
from server.kernels.gemv import RowReductionLinear
from server.kernels.plan import step_plan

CPU = torch.device("cpu")
EAGER, TRACED = step_plan(CPU, torch.float32), step_plan(CPU, torch.float32, traced=True)
# The CPU taken for a device whose GEMM library splits K (CUDA), as the compiled step there plans it.
REDUCING = dataclasses.replace(TRACED, row_reduction_linear=True)


def _fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _compiled_ir_nodes(fn, *args):
    """fn compiled for one static shape, and the number of IR nodes inductor lowered it to (no cache, so that
    inductor lowers it here)."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(fn, dynamic=False, fullgraph=True)(*args)
    return out, metrics.ir_nodes_pre_fusion


@pytest.mark.parametrize("bias", [False, True])
def test_the_one_token_row_reduction_matches_linear_and_stores_its_input_first(bias):
    """At one token, compiled: the product of the input's producer (a cheap product, which inductor would inline
    and recompute for every output row) is stored, then one reduction; the values are F.linear's."""
    gen = _fresh_generator()
    layer = RowReductionLinear(96, 40, bias=bias)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    a, b = torch.randn(1, 1, 96, generator=gen), torch.randn(1, 1, 96, generator=gen)
    got, num_nodes = _compiled_ir_nodes(lambda a, b: layer(a * b, REDUCING), a, b)
    torch.testing.assert_close(got, F.linear(a * b, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert num_nodes == 2 + bias  # the product, the reduction (and the bias add, fused into its kernel)


def test_only_one_token_compiled_with_no_more_outputs_than_inputs_on_a_reducing_device_reduces(monkeypatch):
    taken = []
    monkeypatch.setattr(gemv, "row_reduction_linear", lambda *args: taken.append(args[1].shape) or F.linear(*args))
    layers = {"o_proj": RowReductionLinear(64, 64), "down": RowReductionLinear(128, 64),
              "wide": RowReductionLinear(64, 128)}
    one_token = {name: torch.randn(1, layer.in_features) for name, layer in layers.items()}
    for name, layer in layers.items():  # the CPU's GEMM splits nothing: F.linear
        _compiled_ir_nodes(layer, one_token[name], TRACED)
    assert not taken
    for name, layer in layers.items():
        expected = F.linear(one_token[name], layer.weight, layer.bias)
        torch.testing.assert_close(layer(one_token[name], EAGER), expected)
        _compiled_ir_nodes(layer, torch.randn(2, layer.in_features), REDUCING)  # two tokens
    assert not taken
    for name, layer in layers.items():
        _compiled_ir_nodes(layer, one_token[name], REDUCING)
    assert taken == [(64, 64), (64, 128)]  # o_proj and down; the wide layer keeps F.linear
