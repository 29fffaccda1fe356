"""The one-token row reduction of RowReductionLinear (CPU, inductor's C++ code)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.kernels import gemv
from server.kernels.gemv import RowReductionLinear, prefer_row_reduction


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
    prefer_row_reduction(layer, True)
    a, b = torch.randn(1, 1, 96, generator=gen), torch.randn(1, 1, 96, generator=gen)
    got, num_nodes = _compiled_ir_nodes(lambda a, b: layer(a * b), a, b)
    torch.testing.assert_close(got, F.linear(a * b, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert num_nodes == 2 + bias  # the product, the reduction (and the bias add, fused into its kernel)


def test_more_tokens_eager_and_unpreferred_layers_take_linear(monkeypatch):
    layer = RowReductionLinear(32, 16)
    prefer_row_reduction(layer, True)
    taken = []
    monkeypatch.setattr(gemv, "row_reduction_linear", lambda *args: taken.append(args) or F.linear(*args))
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer(x[:1]), F.linear(x[:1], layer.weight, layer.bias))  # eager: no reduction
    _compiled_ir_nodes(layer, x)  # two tokens
    assert not taken
    _compiled_ir_nodes(layer, x[:1])
    assert len(taken) == 1
    prefer_row_reduction(layer, False)
    _compiled_ir_nodes(layer, x[:1])
    assert len(taken) == 1


def test_only_layers_with_no_more_outputs_than_inputs_and_a_preferring_step_reduce():
    model = nn.ModuleDict({"o_proj": RowReductionLinear(64, 64), "down": RowReductionLinear(128, 64),
                           "wide": RowReductionLinear(64, 128), "router": nn.Linear(64, 8)})
    prefer_row_reduction(model, True)
    assert [name for name, m in model.items() if getattr(m, "reduces_one_token", None)] == ["o_proj", "down"]
    prefer_row_reduction(model, False)
    assert not any(getattr(m, "reduces_one_token", False) for m in model.values())


def test_the_decode_step_reduces_only_on_cuda():
    assert gemv.reduces_one_token(torch.device("cuda"))
    assert not gemv.reduces_one_token(torch.device("mps")) and not gemv.reduces_one_token(torch.device("cpu"))
