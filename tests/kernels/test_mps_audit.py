"""The Mac path audited on the CPU: engines planned for MPS with torch 2.15's capabilities (read from the table
tools/mps_ops/generate.py builds out of the 2.15.0 release) serve every architecture in every precision under a
recorder of aten ops; each op must have an MPS kernel for its dtypes (or decompose into ops that do). The compiled
decode step's post-grad graph is checked against what inductor's Metal backend lowers and what it calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from server.compile.decode_graphs import DecodeRows, DecodeStep
from server.kernels.mps_ops import fallback_report, mps_table, ops_not_on_mps, plan_ops, table_capabilities
from server.kernels.plan import build_step_plan
from tests.mps_audit import (
    ARCHS,
    PRECISIONS,
    OpRecorder,
    checkpoint,
    metal_audit,
    mps_engine,
    post_grad_graph,
    record_serving,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mps-audit")


def test_the_table_is_torch_2_15s_own():
    table = mps_table()
    assert (table.torch_version, table.commit) == ("2.15.0", "d0f2af8b66b20da4baa50644c0cd3f887a2eae2e")
    assert table.kind("aten::_grouped_mm") == table.kind("aten::_scaled_mm_v2") == "mps"
    assert table.kind("aten::_scaled_mm") == table.kind("aten::_scaled_grouped_mm_v2") == "missing"
    assert table.kind("aten::linalg_svd") == "cpu_fallback" and table.kind("aten::matmul") == "composite_implicit"
    assert "float64" in table.never_dtypes and "float8_e4m3fn" not in table.metal["dtypes"]


def test_the_audit_flags_what_mps_lacks():
    """Ops without an MPS kernel, float8 arithmetic and float64 tensors, recorded by the same recorder (in inference
    mode, as steps run: there composite ops reach the recorder whole)."""
    recorder = OpRecorder(mps_table())
    a = torch.randn(4, 8)
    with torch.inference_mode(), recorder:
        torch._scaled_mm(a.to(torch.float8_e4m3fn), a.t().to(torch.float8_e4m3fn).t().contiguous().t(),
                         torch.ones(()), torch.ones(()), out_dtype=torch.bfloat16)
        a.to(torch.float8_e4m3fn).view(torch.uint8) + 1  # bytes: fine
        torch.cat([a.to(torch.float8_e4m3fn)] * 2).flip(0)  # MPS has no float8 flip kernel
        a.double().sum()
        a @ a.t()  # matmul decomposes (mm)
        torch.nn.functional.rms_norm(a, (8,))  # on MPS its composite calls MPS's _fused_rms_norm
    problems = ops_not_on_mps(recorder.ops)
    assert set(problems) == {"aten::_scaled_mm", "aten::flip", "aten::_to_copy", "aten::sum"}, problems
    assert "float64" in problems["aten::sum"] and "float8_e4m3fn" in problems["aten::flip"]
    assert {"aten::matmul", "aten::mm", "aten::rms_norm"} <= set(recorder.ops)
    assert mps_table().kind("aten::rms_norm") == "mps_choice"


def test_the_mps_plan_takes_the_forms_torch_2_15_has():
    """The findings of the audit, as the plan builder decides them from the table's capabilities."""
    caps = table_capabilities()
    eager = build_step_plan(caps, "mps", torch.bfloat16, traced=False)
    traced = build_step_plan(caps, "mps", torch.bfloat16, traced=True)
    assert eager.fp8_rowwise and eager.grouped_mm and not eager.fp8_grouped  # no _scaled_grouped_mm on MPS
    assert not traced.private_ops  # torch._scaled_mm has no MPS kernel; F.scaled_mm's _scaled_mm_v2 has
    assert traced.opaque_fp8_casts and not traced.fp8_weight_only  # Metal codegen has no float8 type
    assert not eager.opaque_fp8_casts


@pytest.mark.parametrize("arch", ARCHS)
def test_every_op_of_the_mps_plan_has_an_mps_kernel(arch, root):
    """Loading, prefill, eager decode and sampling of `arch` in every precision, planned for MPS."""
    listed = plan_ops()
    for precision in PRECISIONS:
        ops = record_serving(arch, precision, root)
        assert ops_not_on_mps(ops) == {}, f"{arch} {precision}"
        unlisted = sorted(set(ops) - set(listed))
        assert not unlisted, (f"{arch} {precision} runs ops mps_plan_ops.json does not list (mps-serve info checks "
                              f"that list on a Mac): {unlisted}; run `PYTHONPATH=. python tools/mps_ops/record_plan.py`")


def test_the_listed_plan_ops_all_run_on_mps():
    assert ops_not_on_mps({name: {tuple(dtypes)} for name, dtypes in plan_ops().items()}) == {}


def test_info_names_the_plan_ops_that_would_run_on_the_cpu():
    report = fallback_report(False, {"aten::add.Tensor": ["bfloat16"], "aten::_scaled_mm": ["float8_e4m3fn"],
                                     "aten::linalg_svd": ["float32"]})
    assert "2 would run through the CPU fallback" in report[0]
    assert any("aten::_scaled_mm: no MPS kernel" in line for line in report)
    assert any("aten::linalg_svd" in line and "MPSFallback" in line for line in report)
    assert "none would run" in fallback_report(False)[0]


def test_the_compiled_decode_step_lowers_for_metal(root):
    """An FP8 MoE's compiled decode step (the widest mix: attention, routing, grouped experts, FP8 linears) as
    inductor gets it after its decompositions: generated kernels need Metal types, the rest MPS aten kernels."""
    engine = mps_engine(*checkpoint("qwen3_moe", "fp8", root))
    plans = engine.runner.plans
    inline = dataclasses.replace(plans.compiled, layers="inline", fused_top_k=False)  # one graph, the same ops
    rows = DecodeRows()
    step = DecodeStep(engine.model, engine.kv_cache.layers, None, rows, False, dataclasses.replace(plans, compiled=inline))
    with torch.inference_mode():
        graph = post_grad_graph(step.forward, torch.tensor([rows.padding_row(4)] * 2), torch.zeros(8, dtype=torch.int64))
    how, problems = metal_audit(graph, mps_table())
    assert problems == {}
    aten_kernels = sorted(op for op, kind in how.items() if kind == "aten kernel")
    # what the Metal backend hands to MPS's own kernels (named here for the reader of a failure)
    assert {"aten::_scaled_mm_v2", "mps_serve::fp8_cast"} <= set(aten_kernels), aten_kernels
    assert sum(kind == "metal" for kind in how.values()) > 10
