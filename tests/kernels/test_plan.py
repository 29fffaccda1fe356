"""The step plan builder: the forms each device runs, eager and traced, from the probe's capabilities."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from server.kernels import compat
from server.kernels.capabilities import Capabilities, Probe
from server.kernels.plan import StepPlan, StepPlans, build_step_plan, build_step_plans, step_plan

YES, NO = Probe(True, "told so by the test"), Probe(False, "told so by the test")
PROBES = [field.name for field in dataclasses.fields(Capabilities) if field.type in ("Probe", Probe)]


def caps(device: str, **answers: bool) -> Capabilities:
    """Capabilities that say yes to every fast path but those `answers` name."""
    probes = {name: YES if answers.get(name, True) else NO for name in PROBES}
    return Capabilities(device=device, torch_version=torch.__version__, **probes)


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_eager_plans_take_no_compiled_only_form(device):
    plan = build_step_plan(caps(device), device, torch.bfloat16, traced=False)
    assert plan.catch_fast_path_failures and plan.layers == "eager"
    compiled_only = ("row_reduction_linear", "fp8_weight_only", "moe_gather_reduce", "regions_compile_once",
                     "fused_top_k", "pointwise_winners_softmax", "private_ops", "partial_rope_whole_head",
                     "fused_state_update", "shared_gate_reduction", "flex_listed_blocks")
    assert not any(getattr(plan, name) for name in compiled_only)
    assert plan.fp8_rowwise and plan.fp8_rowwise_bias and plan.grouped_mm and plan.fp8_grouped  # as probed


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_traced_plans_by_device(device):
    plan = build_step_plan(caps(device), device, torch.bfloat16, traced=True)
    regions = compat.regions_compile_once()
    assert not plan.catch_fast_path_failures and plan.private_ops
    assert plan.row_reduction_linear == (device == "cuda")  # where the GEMM library splits K
    assert plan.moe_gather_reduce == (device != "mps")  # MPS keeps its measured grouped_mm
    assert plan.flex_kv_tile == (device == "cuda") and plan.two_stage_argmax == (device != "cpu")
    assert plan.fp8_weight_only and plan.pointwise_winners_softmax and plan.partial_rope_whole_head
    assert plan.fused_state_update and plan.shared_gate_reduction and plan.flex_listed_blocks
    assert plan.layers == ("regions" if regions else "inline") and plan.fused_top_k == regions


def test_the_probe_decides_the_fast_paths_and_traced_grouped_mm_needs_its_shape_function():
    plan = build_step_plan(caps("cuda", fp8_rowwise=False, fp8_weight_only=False, fp8_grouped=False), "cuda",
                           torch.bfloat16, traced=True)
    assert not (plan.fp8_rowwise or plan.fp8_weight_only or plan.fp8_grouped) and plan.fp8_rowwise_bias
    no_meta = caps("cpu", grouped_mm_bf16_traced=False)
    assert build_step_plan(no_meta, "cpu", torch.bfloat16, traced=False).grouped_mm
    assert not build_step_plan(no_meta, "cpu", torch.bfloat16, traced=True).grouped_mm
    assert not build_step_plan(caps("cpu"), "cpu", torch.int8, traced=False).grouped_mm  # no such dtype


def test_an_engine_has_an_eager_a_compiled_and_a_layers_inline_plan():
    plans = build_step_plans(caps("cuda"), "cuda", torch.bfloat16)
    assert isinstance(plans, StepPlans) and not plans.eager.private_ops and plans.compiled.private_ops
    inline = plans.compiled_layers_inline
    assert not inline.fused_top_k  # a fused top-k is worth generating once per region, not once per layer
    assert inline.layers == ("regions" if compat.regions_inline_after_tracing() else "inline")
    assert dataclasses.replace(inline, fused_top_k=plans.compiled.fused_top_k,
                               layers=plans.compiled.layers) == plans.compiled
    assert plans.compiled.for_inline_call() == dataclasses.replace(plans.compiled, fused_top_k=False)


def test_plan_fields_are_constants_dynamo_folds():
    """bools and strings only: an int would be made symbolic under dynamic shapes."""
    assert all(field.type in ("bool", "str") for field in dataclasses.fields(StepPlan))


def test_a_compiled_function_given_an_equal_plan_does_not_recompile():
    compiles = []

    def backend(graph_module, example_inputs):
        compiles.append(1)
        return graph_module.forward

    def step(x, plan: StepPlan):
        return x * 2 if plan.fused_top_k and plan.layers != "eager" else x + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, dynamic=True)
    for size in (3, 5, 7):  # a new, equal plan per call, as a rebuilt engine's
        compiled(torch.randn(size), step_plan("cpu", torch.float32, traced=True))
    assert len(compiles) == 1
    compiled(torch.randn(3), dataclasses.replace(step_plan("cpu", torch.float32, traced=True), layers="eager"))
    assert len(compiles) == 2


def test_traced_steps_keep_to_what_the_device_has_of_the_private_spellings_and_of_float8_codegen():
    """torch 2.15 on MPS: no torch._scaled_mm (traced steps call the public op, whose _scaled_mm_v2 it has) and no
    float8 type in inductor's Metal generator (casts as kernel calls, no FP8 weights read in generated code)."""
    traced = build_step_plan(caps("mps", private_spellings=False, fp8_codegen=False), "mps", torch.bfloat16, traced=True)
    assert not traced.private_ops and traced.opaque_fp8_casts and not traced.fp8_weight_only
    eager = build_step_plan(caps("mps", private_spellings=False, fp8_codegen=False), "mps", torch.bfloat16, traced=False)
    assert not eager.opaque_fp8_casts  # eager casts are the device's cast kernels already
    assert not build_step_plan(caps("cuda"), "cuda", torch.bfloat16, traced=True).opaque_fp8_casts
