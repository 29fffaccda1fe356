"""Shared layers against their Hugging Face twins, bit for bit in the low-precision dtypes models run in."""

from __future__ import annotations

import shutil

import pytest
import torch

from server.kernels.plan import step_plan
from server.models.layers import RMSNorm

EAGER = step_plan("cpu", torch.float32)
# A layer traced inline (no fused router top-k), as a compiled step runs the layers that are not regions.
INLINE = step_plan("cpu", torch.float32, traced=True).for_inline_call()


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
        got = torch.compile(lambda t: moe(t, INLINE), backend=record, fullgraph=True)(x)
        expected = moe(x, EAGER)
    assert linear_weights and (1, 64) not in linear_weights
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lambda t: moe(t, INLINE), fullgraph=True)(x), expected,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_partial_rope_matches_eager_and_passes_the_rest_exactly(dtype):
    """Compiled, partial rotary is one expression over the whole head (cos padded with ones, sin with zeros)."""
    from server.models.layers import apply_rope

    gen = torch.Generator().manual_seed(dtype.itemsize)
    x = torch.randn(3, 5, 32, generator=gen).to(dtype)
    cos, sin = torch.randn(3, 8, generator=gen).to(dtype), torch.randn(3, 8, generator=gen).to(dtype)
    torch._dynamo.reset()
    got = torch.compile(apply_rope, fullgraph=True)(x, cos, sin, INLINE.partial_rope_whole_head)
    expected = apply_rope(x, cos, sin, EAGER.partial_rope_whole_head)
    assert torch.equal(got[..., 8:], x[..., 8:])
    tolerance = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # eager rounds after each op
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
def test_compiled_gated_attention_norms_q_and_k_heads_as_one_tensor():
    """Compiled, Qwen3-Next/3.5 attention norms and rotates its q and k heads together (one kernel on a GPU
    where each tensor took its own), with the eager values."""
    from server.models.hybrid import GatedAttention

    torch.manual_seed(0)
    attn = GatedAttention(64, 4, 2, 32, 1e-6)
    for param in attn.parameters():
        torch.nn.init.normal_(param, std=0.3)
    rope = torch.randn(3, 8), torch.randn(3, 8)
    norms = []

    def record(graph_module, example_inputs):
        norms.extend(n for n in graph_module.graph.nodes if n.op == "call_function" and "rms_norm" in str(n.target))
        return graph_module.forward

    def norm_rope(q, k, plan):
        return attn._norm_rope_qk(q, k, rope, plan)

    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(norm_rope, backend=record, fullgraph=True)(q, k, INLINE)
        got, expected = torch.compile(norm_rope, fullgraph=True)(q, k, INLINE), norm_rope(q, k, EAGER)
    assert len(norms) == 1
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


class _OneTokenReduction(torch.nn.Module):
    """A linear as the tuned CUDA step compiles it at one token (the router; o_proj, standing in for attention): a
    reduction inductor generates, whose output is a stored buffer and whose input (unlike a library mm's) need not
    be. Extra arguments (an attention's rope, metadata and cache) are ignored."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)  # a router's own weight is shared, not copied

    def forward(self, x: torch.Tensor, *ignored) -> torch.Tensor:
        return (x.unsqueeze(-2) * self.weight).sum(-1)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("block_kind", ["softmax", "sigmoid-bias"])
def test_compiled_decoder_layer_stores_the_moe_block_input_once_for_the_router_and_the_experts(block_kind):
    """A decoder layer stores its FFN's input (the post-attention norm's output) in one buffer, not recomputed
    inside the MoE router's and each expert projection's reduction for every output row; the eager numbers."""
    from server.models.hybrid import SigmoidBiasMoE
    from server.models.layers import DecoderLayer, SoftmaxMoE
    from tests.kernels.test_moe import _stored_buffers

    hidden = 32
    if block_kind == "softmax":
        block = SoftmaxMoE(hidden, num_experts=16, top_k=2, intermediate_size=8, renormalize=True)
    else:
        block = SigmoidBiasMoE(hidden, 16, 2, 8, renormalize=True, scaling=1.0, use_bias=True)
        block.expert_bias.normal_()
    names = ("input_layernorm", "mixer", "post_attention_layernorm", "mlp")
    layer = DecoderLayer(names, _OneTokenReduction(torch.empty(hidden, hidden)), block, lambda: RMSNorm(hidden))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    block.gate = _OneTokenReduction(block.gate.weight)

    def decode(x, plan=INLINE):
        return layer(x, None, None, None, plan)

    x = torch.randn(1, hidden)
    assert ("Pointwise", [1, hidden]) in _stored_buffers(decode, x)[:-1]  # the last: the layer's output
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(decode, fullgraph=True)(x), decode(x, EAGER), rtol=1e-5, atol=1e-6)

