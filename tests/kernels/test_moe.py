"""MoE routing and experts against Hugging Face's modules and the loop twin, on fresh random inputs."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from server.kernels import moe
from server.kernels.plan import step_plan
from tests.kernels.sync_guard import assert_no_host_sync

CPU = torch.device("cpu")
EAGER = step_plan(CPU, torch.float32)  # routing reads no dtype- or device-dependent field
TRACED = step_plan(CPU, torch.float32, traced=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return gate_up, down


def _config(num_experts=16, top_k=4, hidden=64, inter=32, norm_topk_prob=True, **extra):
    return SimpleNamespace(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
        _experts_implementation="eager",
        **extra,
    )


def _by_expert(weights: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert, weight) pairs ordered by expert id: the routers return the top k unsorted."""
    ids, order = expert_ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_softmax_matches_qwen3_moe_router(renormalize):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(_config(norm_topk_prob=renormalize))
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(11, 64)
    logits, hf_weights, hf_ids = router(hidden)
    weights, expert_ids = moe.route_softmax(logits, 4, renormalize, EAGER)
    assert weights.dtype == logits.dtype and expert_ids.dtype == torch.int64
    (weights, expert_ids), (hf_weights, hf_ids) = _by_expert(weights, expert_ids), _by_expert(hf_weights, hf_ids)
    assert torch.equal(expert_ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_sigmoid_bias_matches_lfm2_moe_router(use_bias, dtype):
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    router = Lfm2MoeTopKRouter(_config(routed_scaling_factor=1.7, use_expert_bias=use_bias)).to(dtype)
    torch.nn.init.normal_(router.weight)
    expert_bias = torch.randn(16) * 0.5 if use_bias else None
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(torch.randn(9, 64, dtype=dtype), expert_bias)
    weights, expert_ids = moe.route_sigmoid_bias(logits, expert_bias, 4, True, 1.7, EAGER)
    (weights, expert_ids), (hf_weights, hf_ids) = _by_expert(weights, expert_ids), _by_expert(hf_weights, hf_ids)
    assert torch.equal(expert_ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_moe_experts_matches_hf_qwen3_moe_experts(num_tokens):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf = Qwen3MoeExperts(_config())
    gate_up, down = _experts(16, 64, 32, torch.float32, seed=num_tokens)
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up)
        hf.down_proj.copy_(down)
    x = torch.randn(num_tokens, 64)
    weights, expert_ids = moe.route_softmax(torch.randn(num_tokens, 16), 4, True, EAGER)
    with torch.no_grad():
        ref = hf(x, expert_ids, weights)
    assert _rel_err(moe.moe_experts(x, weights, expert_ids, gate_up, down, EAGER), ref) < 1e-5


PATHS = {
    "grouped": functools.partial(moe._experts_grouped, private=False),
    "gather_bmm": moe._experts_gather_bmm,
    "dense": moe._experts_dense,
    "gather_reduce": moe._experts_gather_reduce,  # compiled-only in use; eager here on tiny shapes is fine
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_every_experts_path_matches_loop_twin(path, dtype, tol, num_tokens):
    gate_up, down = _experts(8, 48, 24, dtype, seed=num_tokens)
    x = torch.randn(num_tokens, 48).to(dtype)
    # skewed routing: a few hot experts and some never chosen, so groups of very different sizes and empty ones
    logits = torch.randn(num_tokens, 8) + torch.tensor([3.0, 2.0, 0, 0, -9, 0, 1, -9])
    weights, expert_ids = moe.route_softmax(logits.to(dtype), 3, True, EAGER)
    ref = moe.moe_experts_reference(x.double(), weights.double(), expert_ids, gate_up.double(), down.double())
    out = PATHS[path](x, weights, expert_ids, gate_up, down)
    assert out.dtype == dtype and out.shape == x.shape
    assert _rel_err(out, ref) < tol


def test_sort_by_expert_offsets_are_int32_group_ends():
    expert_ids = torch.randint(0, 12, (30, 4))
    order, offs = moe.sort_by_expert(expert_ids, 12)
    assert offs.dtype == torch.int32
    counts = torch.bincount(expert_ids.flatten(), minlength=12)
    assert torch.equal(offs.long(), counts.cumsum(0))
    sorted_ids = expert_ids.flatten()[order]
    assert torch.equal(sorted_ids, sorted_ids.sort().values)


def test_moe_experts_makes_no_host_sync():
    gate_up, down = _experts(8, 32, 16, torch.float32, seed=1)
    x = torch.randn(5, 32)
    weights, expert_ids = moe.route_softmax(torch.randn(5, 8), 2, True, EAGER)
    with assert_no_host_sync():
        moe.moe_experts(x, weights, expert_ids, gate_up, down, EAGER)
        moe.route_sigmoid_bias(torch.randn(5, 8), torch.randn(8), 2, True, 2.0, EAGER)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
# bf16 x 4 tokens: grouped_mm; fp32: fallback (grouped_mm's shape function takes bf16 only); 1 token: gather-reduce
@pytest.mark.parametrize("dtype,num_tokens", [(torch.bfloat16, 4), (torch.float32, 4), (torch.bfloat16, 1)])
def test_route_and_experts_compile_fullgraph_on_cpu(dtype, num_tokens):
    gate_up, down = _experts(8, 32, 16, dtype, seed=2)

    def block(x, router_logits, plan):
        weights, expert_ids = moe.route_softmax(router_logits, 2, True, plan)
        return moe.moe_experts(x, weights, expert_ids, gate_up, down, plan)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x, logits = torch.randn(num_tokens, 32).to(dtype), torch.randn(num_tokens, 8).to(dtype)
    out = compiled(x, logits, step_plan(CPU, dtype, traced=True))
    assert _rel_err(out, block(x, logits, step_plan(CPU, dtype))) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_top_k_picks_the_same_winners_as_topk(dtype):
    # 128 bf16 draws per row hold ties, which the rounds must split without picking an index twice
    scores = torch.randn(37, 128).to(dtype)
    scores[0, :20] = scores[0, 5]  # a tie wider than k
    torch._dynamo.reset()
    values, ids = torch.compile(moe.top_k_unsorted, fullgraph=True, dynamic=False)(scores, 8, True)
    expected = torch.topk(scores, 8, dim=-1).values
    assert ids.dtype == torch.int64 and values.shape == ids.shape == (37, 8)
    assert torch.equal(values.sort(dim=-1, descending=True).values, expected)
    assert torch.equal(scores.gather(1, ids), values)
    assert all(len(set(row)) == 8 for row in ids.tolist())


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("use_bias", [False, True])
def test_compiled_routers_match_eager(use_bias):
    logits = torch.randn(9, 32)
    bias = torch.randn(32) if use_bias else None
    torch._dynamo.reset()
    for route in (lambda t, plan: moe.route_softmax(t, 4, True, plan),
                  lambda t, plan: moe.route_softmax(t, 4, False, plan),
                  lambda t, plan: moe.route_sigmoid_bias(t, bias, 4, True, 1.7, plan)):
        weights, expert_ids = torch.compile(route, fullgraph=True, dynamic=False)(logits, TRACED)
        eager_weights, eager_ids = _by_expert(*route(logits, EAGER))
        weights, expert_ids = _by_expert(weights, expert_ids)
        assert torch.equal(expert_ids, eager_ids)
        torch.testing.assert_close(weights, eager_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("top_k", [2, 8])
def test_compiled_winners_softmax_is_pointwise_and_matches_softmax(top_k):
    """Routing as inline layers compile it (torch.topk): the softmax over the winners stores no reduction (its
    row max and sum are pointwise over the k columns), and matches eager, also where the winners lie far apart."""
    logits = torch.randn(6, 32) * 3
    logits[0, :top_k] = torch.linspace(-150.0, 150.0, top_k)  # exp of any difference here overflows float32

    inline = TRACED.for_inline_call()

    def route(t, plan=inline):
        return moe.route_softmax(t, top_k, True, plan)

    weights, expert_ids = _by_expert(*torch.compile(route, fullgraph=True, dynamic=False)(logits))
    eager_weights, eager_ids = _by_expert(*route(logits, EAGER))
    assert torch.equal(expert_ids, eager_ids)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-6, atol=1e-7)
    stored = _stored_buffers(route, logits[:1])
    assert [kind for kind, size in stored if size == [1, 1]] == ["Pointwise", "Pointwise"]  # the max, the sum
    assert all(kind == "Pointwise" for kind, _ in stored)


@pytest.mark.parametrize("fuse", [True, False])
def test_routers_fuse_top_k_only_when_asked(fuse):
    """A layer compiled inline (fused_top_k=False) keeps torch.topk: the fused rounds are slow to generate per
    layer."""
    plan = dataclasses.replace(TRACED, fused_top_k=fuse)
    traced_ops = []

    def record(graph_module, example_inputs):
        traced_ops.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    route = torch.compile(lambda t: moe.route_softmax(t, 4, True, plan), backend=record, fullgraph=True)
    logits = torch.randn(3, 16)
    weights, expert_ids = _by_expert(*route(logits))
    assert any("topk" in op for op in traced_ops) != fuse
    eager_weights, eager_ids = _by_expert(*moe.route_softmax(logits, 4, True, EAGER))
    assert torch.equal(expert_ids, eager_ids)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-6, atol=1e-7)


def _stored_buffers(fn, *args) -> list[tuple[str, list[int]]]:
    """(IR node kind, size) of every buffer inductor stores for `fn` compiled at these static shapes, with a GPU's
    realize heuristics (the CPU's store some reused expressions that a GPU's inline)."""
    from torch._inductor import graph as inductor_graph
    from torch._inductor import ir as inductor_ir

    stored, codegen = [], inductor_graph.GraphLowering.codegen

    def record_then_codegen(graph, *rest, **kwargs):
        stored.extend((type(b.data).__name__, [int(s) for s in b.get_size()])
                      for b in graph.buffers if type(b).__name__ == "ComputedBuffer")
        return codegen(graph, *rest, **kwargs)

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(inductor_graph.GraphLowering, "codegen", record_then_codegen)
        patch.setattr(inductor_ir, "is_cpu", lambda node: False)  # ir.py asks it only for realize heuristics
        torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    return stored


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("fp8", [False, True])
def test_gather_reduce_reads_each_chosen_expert_in_place_with_the_swiglu_beside_its_reductions(fp8):
    """At one token: no copy of the chosen experts' weights is stored, and gate and up are reductions of the
    SwiGLU's own shape [k, I] (so inductor makes the SwiGLU their epilogue, one kernel), then the down reduction
    and the residual add."""
    from server.kernels import moe_fp8

    num_experts, hidden, inter, top_k = 16, 64, 32, 4
    gate_up, down = _experts(num_experts, hidden, inter, torch.float32, seed=int.from_bytes(os.urandom(2), "little"))
    if fp8:
        (gate_up_q, gate_up_scale), (down_q, down_scale) = (moe_fp8.quantize_experts(w) for w in (gate_up, down))

        def experts(x, weights, expert_ids):
            return moe_fp8._experts_gather_reduce_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q,
                                                      down_scale)
    else:
        def experts(x, weights, expert_ids):
            return moe._experts_gather_reduce(x, weights, expert_ids, gate_up, down)

    def experts_and_residual(x, weights, expert_ids, residual):
        return residual + experts(x, weights, expert_ids)

    weights, expert_ids = moe.route_softmax(torch.randn(1, num_experts), top_k, True, EAGER)
    stored = _stored_buffers(experts_and_residual, torch.randn(1, hidden), weights, expert_ids, torch.randn(1, hidden))
    assert max(len(size) for _, size in stored) <= 2  # nothing of [k, rows, H]: the weights are read in place
    assert [kind for kind, size in stored if size == [top_k, inter]] == ["Reduction", "Reduction", "Pointwise"]
    # bf16: down and the weighted combine as one reduction over (slot, i), then the add; FP8: down per slot, then
    # the weighted sum over the slots and the add, pointwise (one kernel on CUDA: counted in docs/PERF.md)
    reductions = [size for kind, size in stored if kind == "Reduction"]
    assert reductions[-1] == [top_k if fp8 else 1, hidden]
    assert stored[-1] == ("Pointwise", [1, hidden])
