"""Shared layers against their Hugging Face twins, bit for bit in the low-precision dtypes models run in."""

from __future__ import annotations

import shutil

import pytest
import torch

from server.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_transformers(dtype, zero_centered):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    gen = torch.Generator().manual_seed(int(zero_centered) * 10 + dtype.itemsize)
    x = (3 * torch.randn(37, 256, generator=gen)).to(dtype)
    weight = 0.1 * torch.randn(256, generator=gen) + (0.0 if zero_centered else 1.0)
    ref = Qwen3NextRMSNorm(256, eps=1e-6) if zero_centered else LlamaRMSNorm(256, eps=1e-6)
    ours = RMSNorm(256, eps=1e-6, zero_centered=zero_centered)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        ref, ours = ref.to(dtype), ours.to(dtype)
        expected, got = ref(x), ours(x)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
def test_compiled_shared_expert_gate_is_a_reduction_not_a_linear():
    """Compiled, the one-row shared-expert gate is a reduction inductor generates (a BLAS call of two kernels on
    CUDA otherwise), with the eager output."""
    from server.models.hybrid import SharedExpertMoE

    torch.manual_seed(0)
    moe = SharedExpertMoE(64, 16, 4, 32, 48, True)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    linear_weights = []

    def record(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target is torch._C._nn.linear:
                linear_weights.append(tuple(node.args[1].meta["example_value"].shape))
        return graph_module.forward

    torch._dynamo.reset()
    x = torch.randn(3, 64)
    with torch.no_grad():
        got = torch.compile(lambda t: moe(t, False), backend=record, fullgraph=True)(x)
        expected = moe(x, False)
    assert linear_weights and (1, 64) not in linear_weights
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lambda t: moe(t, False), fullgraph=True)(x), expected,
                                   rtol=1e-5, atol=1e-6)
