"""FP8 row-wise weights: quantization, linear, block-wise conversion, MoE experts, per-layer policy.

Error bounds, relative to the bf16 (or fp32) product of the unquantized operands: e4m3 keeps 3 mantissa bits,
so one quantized operand costs a few percent, and both operands of a GEMV or a whole MoE layer add up to the
bounds below. Against its own twin (same quantized operands) the fast path must agree to bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from server.kernels import fp8, moe, moe_fp8
from server.kernels.plan import step_plan
from tests.helpers import needs_cpu_scaled_mm

CPU = torch.device("cpu")

FP8_LINEAR_BOUND = 6e-2  # both operands quantized, vs the bf16 product
FP8_WEIGHT_ONLY_BOUND = 4e-2  # one weight quantized, activations not
FP8_MOE_BOUND = 1e-1  # two quantized weights in sequence (gate_up, down): ~4.7e-2 mean, 6.5e-2 max over 30 seeds


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_quantize_rowwise_roundtrip():
    weight = torch.randn(96, 160) * torch.logspace(-3, 2, 96).unsqueeze(1)  # rows of very different scales
    weight[5] = 0.0
    weight_fp8, scale = fp8.quantize_fp8_rowwise(weight)
    assert weight_fp8.dtype == torch.float8_e4m3fn and scale.shape == (96, 1) and scale.dtype == torch.float32
    deq = weight_fp8.float() * scale
    assert torch.isfinite(deq).all() and (deq[5] == 0).all()
    row_err = (deq - weight).norm(dim=1) / weight.norm(dim=1).clamp_min(1e-30)
    assert row_err[weight.norm(dim=1) > 0].max() < 4e-2  # per row: the scale follows each row's range
    assert torch.equal(weight_fp8.float().abs().amax(dim=1)[weight.norm(dim=1) > 0], torch.full((95,), 448.0))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fp8_linear_matches_twin_and_bf16(with_bias, num_tokens):
    weight = torch.randn(64, 128).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16) if with_bias else None
    x = torch.randn(num_tokens, 128).to(torch.bfloat16)
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(weight)
    x_fp8, x_scale = fp8.quantize_activation(x)
    out = fp8.fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16, step_plan(CPU, torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 64)
    twin = fp8.fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16)
    assert _rel_err(out, twin) < 1e-2
    exact = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert _rel_err(out, exact) < FP8_LINEAR_BOUND


@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_weight_only_matches_twin_and_bf16(with_bias):
    weight = torch.randn(64, 128).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16) if with_bias else None
    x = torch.randn(3, 128).to(torch.bfloat16)
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(weight)
    out = fp8.fp8_weight_only_linear(x, w_fp8, w_scale, bias, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 64)
    twin = fp8.fp8_weight_only_reference(x, w_fp8, w_scale, bias, torch.float32)
    assert _rel_err(out, twin) < 1e-2
    exact = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert _rel_err(out, exact) < FP8_WEIGHT_ONLY_BOUND


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
@pytest.mark.parametrize("num_tokens, has_scaled_mm, weight_only",
                         [(1, False, True), (1, True, True),
                          pytest.param(fp8.WEIGHT_ONLY_MAX_TOKENS + 1, True, False, marks=needs_cpu_scaled_mm)])
def test_compiled_fp8_linear_reads_fp8_in_its_reduction_at_one_token(num_tokens, has_scaled_mm, weight_only):
    """Compiled at one token, with or without a row-wise scaled_mm on the device: one reduction over the FP8
    weight, no activation quantization and no scaled_mm; at more tokens, scaled_mm. Either way the twin's
    numbers."""
    from torch._inductor.utils import run_and_get_code

    plan = step_plan(CPU, torch.bfloat16, traced=True)
    if not has_scaled_mm:  # the choice only: the fallback it replaces would never be traced here
        plan = dataclasses.replace(plan, fp8_rowwise=False, fp8_rowwise_bias=False)

    layer = fp8.Fp8Linear(96, 48, bias=True, dtype=torch.bfloat16)
    layer.copy_from(torch.nn.Linear(96, 48, bias=True, dtype=torch.bfloat16))
    x = torch.randn(num_tokens, 96, dtype=torch.bfloat16)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(layer, fullgraph=True, dynamic=False), x, plan)
    code = "\n".join(code)
    assert ("scaled_mm" not in code) == weight_only
    assert ("448.0" not in code) == weight_only  # FP8_MAX: the activation's quantization
    bias = layer.bias
    if weight_only:
        twin = fp8.fp8_weight_only_reference(x, layer.weight, layer.weight_scale, bias, torch.float32)
    else:
        twin = fp8.fp8_linear_reference(*fp8.quantize_activation(x), layer.weight, layer.weight_scale, bias,
                                        torch.float32)
    assert _rel_err(out, twin) < 1e-2


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
def test_compiled_weight_only_linear_stores_its_input_and_its_output():
    """The weight-only reduction stores its input's producer (here attention's split combine) once instead of
    recomputing it in the reduction for every output row, and its scaled output once instead of inside each
    reader, as a GEMM's output is; the reference's numbers either way."""
    from tests.kernels.test_moe import _stored_buffers

    heads, head_dim, out_features = 4, 16, 48
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(torch.randn(out_features, heads * head_dim))

    def o_proj(linear):
        def run(partial, lse):  # two splits' outputs combined by their log-sum-exp, then the FP8 linear
            split_weights = torch.exp(lse - lse.amax(0))
            out = (partial * split_weights.unsqueeze(-1)).sum(0) / split_weights.sum(0).unsqueeze(-1)
            return linear(out.reshape(1, -1), w_fp8, w_scale, None, torch.float32) * 2
        return run

    partial, lse = torch.randn(2, heads, head_dim), torch.randn(2, heads)
    buffers = _stored_buffers(o_proj(fp8.fp8_weight_only_linear), partial, lse)
    assert ("Pointwise", [1, heads * head_dim]) in buffers, buffers  # the combined input
    assert ("Pointwise", [1, out_features]) in buffers[:-1], buffers  # the scaled output; the last: the `* 2`
    with torch.no_grad():
        got = torch.compile(o_proj(fp8.fp8_weight_only_linear), fullgraph=True)(partial, lse)
    torch.testing.assert_close(got, o_proj(fp8.fp8_weight_only_reference)(partial, lse), rtol=1e-5, atol=1e-5)


def test_fp8_linear_module_copied_from_a_linear_and_fused_rows():
    linear = torch.nn.Linear(96, 48, bias=True, dtype=torch.bfloat16)
    layer = fp8.Fp8Linear(96, 48, bias=True, dtype=torch.bfloat16)
    layer.copy_from(linear)
    assert torch.equal(layer.bias, linear.bias.detach())
    x = torch.randn(2, 1, 96, dtype=torch.bfloat16)
    plan = step_plan(CPU, torch.bfloat16)
    assert layer(x, plan).shape == (2, 1, 48)
    assert _rel_err(layer(x, plan), linear(x).detach()) < FP8_LINEAR_BOUND
    shared = fp8.quantize_activation(x)  # one quantization feeding two projections
    assert torch.equal(layer(x, plan, shared), layer(x, plan))
    q_proj, kv_proj = torch.randn(32, 96), torch.randn(16, 96)  # a fused projection filled piece by piece
    fused = fp8.Fp8Linear(96, 48, dtype=torch.float32)
    fused.load_rows(slice(0, 32), q_proj)
    fused.load_rows(slice(32, 48), kv_proj)
    ref = x.float() @ torch.cat([q_proj, kv_proj]).t()
    assert _rel_err(fused(x.float(), step_plan(CPU, torch.float32)), ref) < FP8_LINEAR_BOUND
    assert fused.weight.dtype == torch.float8_e4m3fn and fused.weight.numel() == 48 * 96  # 1 byte per weight


def test_blockwise_checkpoint_converts_to_rowwise():
    num_rows, num_cols = 300, 200  # not multiples of the 128 block: partial blocks at the edges
    dense = torch.randn(num_rows, num_cols) * 0.05
    rb, cb = -(-num_rows // 128), -(-num_cols // 128)
    scale_inv = torch.rand(rb, cb) * 0.01 + 1e-3
    expand = scale_inv.repeat_interleave(128, 0)[:num_rows].repeat_interleave(128, 1)[:, :num_cols]
    block_fp8 = (dense / expand).clamp(-448, 448).to(torch.float8_e4m3fn)  # what an HF fp8 checkpoint holds
    block_deq = block_fp8.float() * expand
    row_fp8, row_scale = fp8.blockwise_to_rowwise(block_fp8, scale_inv, (128, 128))
    assert row_scale.shape == (num_rows, 1)
    assert _rel_err(row_fp8.float() * row_scale, block_deq) < FP8_WEIGHT_ONLY_BOUND


@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_fp8_experts_match_twin_and_bf16(num_tokens):
    num_experts, hidden, inter, top_k = 12, 64, 32, 3
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / 8
    down = torch.randn(num_experts, hidden, inter) / 6
    gate_up_q, gate_up_scale = moe_fp8.quantize_experts(gate_up)
    down_q, down_scale = moe_fp8.quantize_experts(down)
    assert gate_up_scale.shape == (num_experts, 2 * inter) and down_scale.shape == (num_experts, hidden)
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    plan = step_plan(CPU, torch.bfloat16)
    weights, expert_ids = moe.route_softmax(torch.randn(num_tokens, num_experts).to(torch.bfloat16), top_k, True,
                                            plan)
    args = (x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale)
    out = moe_fp8.moe_experts_fp8(*args, plan)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert _rel_err(out, moe_fp8.moe_experts_fp8_reference(*args)) < 1e-2
    bf16 = moe.moe_experts_reference(x, weights, expert_ids, gate_up.bfloat16(), down.bfloat16())
    assert _rel_err(out, bf16) < FP8_MOE_BOUND


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
def test_fp8_gather_reduce_matches_the_twin_above_the_unroll_threshold():
    """The one-token FP8 experts (down per slot, then the weighted sum over slots as k pointwise terms), eager and
    compiled, compute the loop-over-experts twin's numbers in float32, at several tokens and a top-k of 8 (inductor
    unrolls only shorter sums itself)."""
    num_experts, hidden, inter, top_k, num_tokens = 16, 64, 32, 8, 3
    quantized = (*moe_fp8.quantize_experts(torch.randn(num_experts, 2 * inter, hidden)),
                 *moe_fp8.quantize_experts(torch.randn(num_experts, hidden, inter)))
    x = torch.randn(num_tokens, hidden)
    weights, expert_ids = moe.route_softmax(torch.randn(num_tokens, num_experts), top_k, True,
                                            step_plan(CPU, torch.float32))
    want = moe_fp8.moe_experts_fp8_reference(x, weights, expert_ids, *quantized)
    torch._dynamo.reset()
    compiled = torch.compile(moe_fp8._experts_gather_reduce_fp8, fullgraph=True, dynamic=False)
    for experts in (moe_fp8._experts_gather_reduce_fp8, compiled):  # eager at these widths: a few KB gathered
        torch.testing.assert_close(experts(x, weights, expert_ids, *quantized), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor needs a C++ compiler"
)
def test_fp8_experts_compile_fullgraph_decode_shape():
    gate_up_q, gate_up_scale = moe_fp8.quantize_experts(torch.randn(16, 32, 48) / 7)
    down_q, down_scale = moe_fp8.quantize_experts(torch.randn(16, 48, 16) / 4)

    def block(x, router_logits, plan):
        weights, expert_ids = moe.route_softmax(router_logits, 2, True, plan)
        return moe_fp8.moe_experts_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale, plan)

    x, logits = torch.randn(1, 48, dtype=torch.bfloat16), torch.randn(1, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    traced = step_plan(CPU, torch.bfloat16, traced=True)
    out = torch.compile(block, fullgraph=True, dynamic=False)(x, logits, traced)  # gather-reduce (2 slots of 16)
    weights, expert_ids = moe.route_softmax(logits, 2, True, step_plan(CPU, torch.bfloat16))
    ref = moe_fp8.moe_experts_fp8_reference(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("num_tokens", [1, 20])
def test_opaque_fp8_casts_compute_the_same_numbers(num_tokens):
    """StepPlan.opaque_fp8_casts (compiled MPS steps: the casts as calls of the cast kernel) changes where a cast
    runs, never its result: linear and experts bit for bit equal to the plain casts', on fresh inputs."""
    plan = step_plan(CPU, torch.bfloat16)
    opaque = dataclasses.replace(plan, opaque_fp8_casts=True)
    layer = fp8.Fp8Linear(64, 48, bias=True)
    layer.copy_from(torch.nn.Linear(64, 48).to(torch.bfloat16))
    x = torch.randn(num_tokens, 64).to(torch.bfloat16)
    torch.testing.assert_close(layer(x, opaque), layer(x, plan), rtol=0, atol=0)
    quantized = (*moe_fp8.quantize_experts(torch.randn(8, 64, 64) / 8), *moe_fp8.quantize_experts(torch.randn(8, 64, 32) / 6))
    weights, expert_ids = moe.route_softmax(torch.randn(num_tokens, 8).to(torch.bfloat16), 2, True, plan)
    no_grouped = dataclasses.replace(plan, fp8_grouped=False)  # MPS's form: the experts dequantized
    want = moe_fp8.moe_experts_fp8(x, weights, expert_ids, *quantized, no_grouped)
    got = moe_fp8.moe_experts_fp8(x, weights, expert_ids, *quantized, dataclasses.replace(no_grouped, opaque_fp8_casts=True))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fp8.fp8_cast(x, torch.float8_e4m3fn, True).dtype == torch.float8_e4m3fn
