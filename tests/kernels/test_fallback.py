"""A fast path that the probe passed but that fails at run time: one warning naming it and how to report it, then
the reference path answers, for that call and every later one, with the reference's results."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from server.kernels import compat, fp8, moe, moe_fp8, streams
from server.kernels.capabilities import Probe, capabilities
from server.kernels.plan import step_plan
from tests.helpers import needs_cpu_scaled_mm

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_failures():
    """Runtime failures last for the process: each test starts and ends with none recorded."""
    failures = capabilities(CPU).runtime_failures  # the probe runs here, before any op is broken
    failures.clear()
    yield failures
    failures.clear()


def broken(*args, **kwargs):
    raise RuntimeError("no kernel for this shape on this device")


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def assert_one_warning(caplog, name: str) -> None:
    messages = fallback_warnings(caplog)
    assert len(messages) == 1, messages
    assert f"the {name} fast path failed on cpu" in messages[0]
    assert "no kernel for this shape on this device" in messages[0] or name == "fp8_grouped"
    assert "reference path" in messages[0] and "mps-serve selfcheck" in messages[0]


def _experts(num_tokens: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(8, 64, 48, generator=gen).to(dtype) / 7
    down = torch.randn(8, 48, 32, generator=gen).to(dtype) / 6
    x = torch.randn(num_tokens, 48, generator=gen).to(dtype)
    weights, expert_ids = moe.route_softmax(torch.randn(num_tokens, 8, generator=gen).to(dtype), 2, True,
                                            step_plan(CPU, dtype))
    return x, weights, expert_ids, gate_up, down


def test_grouped_mm_failing_falls_back_with_one_warning(monkeypatch, caplog, fresh_failures):
    plan = step_plan(CPU, torch.float32)
    assert plan.grouped_mm  # the probe passed it: the fast path is chosen
    monkeypatch.setattr(compat, "grouped_mm", broken)
    with caplog.at_level(logging.WARNING):
        for num_tokens, seed in [(1, 0), (9, 1), (3, 2)]:  # few slots (gather + bmm) and many (every expert)
            args = _experts(num_tokens, seed)
            out = moe.moe_experts(*args, plan)
            ref = moe.moe_experts_reference(*args)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_one_warning(caplog, "grouped_mm")
    assert list(fresh_failures) == ["grouped_mm"]


@needs_cpu_scaled_mm
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_scaled_mm_failing_falls_back_with_one_warning(monkeypatch, caplog, fresh_failures, with_bias):
    assert capabilities(CPU).fp8_rowwise.ok and capabilities(CPU).fp8_rowwise_bias.ok
    working = compat.scaled_mm_rowwise
    calls = []

    def fused_bias_broken(a, b, scale_a, scale_b, bias, out_dtype, private=False):
        calls.append(bias is not None)
        if bias is not None or not with_bias:
            raise RuntimeError("no kernel for this shape on this device")
        return working(a, b, scale_a, scale_b, bias, out_dtype, private)

    monkeypatch.setattr(compat, "scaled_mm_rowwise", fused_bias_broken)
    gen = torch.Generator().manual_seed(0)
    w_fp8, w_scale = fp8.quantize_fp8_rowwise(torch.randn(32, 64, generator=gen).to(torch.bfloat16))
    bias = torch.randn(32, generator=gen).to(torch.bfloat16) if with_bias else None
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            x_fp8, x_scale = fp8.quantize_activation(torch.randn(2, 64, generator=gen).to(torch.bfloat16))
            out = fp8.fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16, step_plan(CPU, torch.bfloat16))
            ref = fp8.fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16)
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # with a bias: the fused form fails once, later calls take scaled_mm without the bias, which works
    assert_one_warning(caplog, "fp8_rowwise_bias" if with_bias else "fp8_rowwise")
    assert calls == ([True, False, False] if with_bias else [False])


def test_fp8_grouped_failing_falls_back_with_one_warning(monkeypatch, caplog, fresh_failures):
    """The CPU has no scaled_grouped_mm: a plan that says it has makes the first call fail for real."""
    plan = dataclasses.replace(step_plan(CPU, torch.float32), fp8_grouped=True)
    with caplog.at_level(logging.WARNING):
        for num_tokens, seed in [(1, 3), (9, 4)]:
            x, weights, expert_ids, gate_up, down = _experts(num_tokens, seed)
            quantized = (*moe_fp8.quantize_experts(gate_up), *moe_fp8.quantize_experts(down))
            out = moe_fp8.moe_experts_fp8(x, weights, expert_ids, *quantized, plan)
            ref = moe_fp8.moe_experts_fp8_reference(x, weights, expert_ids, *quantized)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert_one_warning(caplog, "fp8_grouped")


def test_streams_failing_to_start_copy_inline_with_one_warning(monkeypatch, caplog, fresh_failures):
    probed = dataclasses.replace(capabilities(CPU), streams=Probe(True, "told so by the test"))
    monkeypatch.setattr(streams, "capabilities", lambda device: probed)
    monkeypatch.setattr(torch.cpu, "Stream", broken)
    with caplog.at_level(logging.WARNING):
        first, second = streams.DeviceStreams(CPU), streams.DeviceStreams(CPU)
    assert not first.enabled and not second.enabled
    ids = torch.arange(6)
    pending = first.copy_to_host(ids)
    ids.add_(1)
    assert pending.wait().tolist() == list(range(6))
    assert_one_warning(caplog, "streams")
