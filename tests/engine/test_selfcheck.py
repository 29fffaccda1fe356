"""`mps-serve selfcheck`: run as a user runs it (quick, on the CPU) and read its JSON; failures are reported as
FAIL lines, never as a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from server.selfcheck import decode, kernel_pairs
from server.selfcheck.results import FAIL, PASS, SKIP

KERNEL_CHECKS = {"fp8_linear", "fp8_weight_only", "moe_experts", "moe_experts_fp8", "decode_attention_sdpa", "decode_attention_flex",
                 "prefill_attention", "gated_delta_chunked", "gated_delta_step", "causal_conv1d", "sampling",
                 "affine_linear", "affine_experts"}


def test_quick_selfcheck_on_cpu_writes_a_table_a_summary_and_json(tmp_path):
    out = tmp_path / "selfcheck.json"
    env = dict(os.environ, MPS_SERVE_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "server", "selfcheck", "--quick", "--device", "cpu", "--seed", "7",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    system = document["system"]
    assert system["device"] == "cpu" and system["torch"] == torch.__version__ and system["seed"] == 7
    assert system["chip"] and system["os"] and system["quick"] is True
    checks = {(c["section"], c["name"]): c for c in document["checks"]}
    assert {c["status"] for c in checks.values()} <= {PASS, SKIP}
    for name in KERNEL_CHECKS:
        check = checks["kernels", name]
        assert check["status"] == PASS and check["values"]["error"] <= check["values"]["bound"], check
    assert checks["probe", "streams"]["status"] == SKIP and "no device streams" in checks["probe", "streams"]["detail"]
    assert checks["speed", "copy_bandwidth"]["values"]["gb_s"] > 0
    assert checks["speed", "moe_layer"]["values"]["loop_s"] > 0
    tiny = checks["decode", "decode_tiny-moe"]
    assert tiny["status"] == PASS and tiny["values"]["decode_tok_s"] > 0 and tiny["values"]["kernels_per_step"] > 10
    assert 0 < tiny["values"]["roofline_fraction"]
    assert "no preset fits" in checks["decode", "decode_preset"]["detail"]
    assert checks["decode", "compiled_vs_eager"]["status"] == SKIP
    assert document["counts"] == {PASS: sum(c["status"] == PASS for c in checks.values()), FAIL: 0,
                                  SKIP: sum(c["status"] == SKIP for c in checks.values())}
    summary = document["summary"]
    assert summary in done.stdout and "0 fail" in summary and torch.__version__ in summary
    for name in KERNEL_CHECKS:
        assert any(line.split()[:3] == ["kernels", name, PASS] for line in done.stdout.splitlines())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_affine_pairs_pass_and_catch_a_wrong_unpacking(monkeypatch, dtype):
    """Both forms of the int4 / int8 products against the twin, for several seeds; reductions that drop the groups'
    biases fail both pairs (the twin dequantizes on its own)."""
    cpu = torch.device("cpu")
    for seed in range(5):
        checks = {c.name: c for c in kernel_pairs.kernel_checks(cpu, dtype, seed) if c.name.startswith("affine_")}
        assert [c.status for c in checks.values()] == [PASS, PASS], checks
    affine = kernel_pairs.affine
    rows = affine.dequantized_rows
    monkeypatch.setattr(affine, "dequantized_rows", lambda q, scales, biases, *args: rows(q, scales, biases * 0, *args))
    checks = {c.name: c for c in kernel_pairs.kernel_checks(cpu, dtype, 0) if c.name.startswith("affine_")}
    assert [c.status for c in checks.values()] == [FAIL, FAIL], checks


def test_a_kernel_that_raises_or_is_wrong_is_a_fail_line(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(kernel_pairs.fp8, "fp8_linear", broken)
    monkeypatch.setattr(kernel_pairs.moe, "moe_experts", lambda x, *args: torch.zeros_like(x))
    checks = {c.name: c for c in kernel_pairs.kernel_checks(torch.device("cpu"), torch.float32, seed=0)}
    assert checks["fp8_linear"].status == FAIL and checks["fp8_linear"].detail == "RuntimeError: no kernel for this shape"
    assert checks["moe_experts"].status == FAIL and checks["moe_experts"].values["error"] == pytest.approx(1.0)
    assert checks["moe_experts_fp8"].status == PASS  # the others still ran


@pytest.mark.parametrize("memory_gb, expected", [(24, ("llama-3.1-8b", "none")), (13, ("lfm2-8b-a1b", "fp8")),
                                                 (6, (None, None))])
def test_the_decode_preset_is_the_smallest_that_fits_with_the_kv_allowance(monkeypatch, memory_gb, expected):
    monkeypatch.setattr(decode, "device_memory_bytes", lambda device: memory_gb * 10**9)
    preset, quantize, why = decode.fitting_preset(torch.device("cuda"), torch.bfloat16)
    assert (preset, quantize) == expected
    if preset is None:
        assert why.startswith("skipped: no preset fits")
    monkeypatch.setattr(decode, "device_memory_bytes", lambda device: None)
    assert decode.fitting_preset(torch.device("cpu"), torch.float32)[2].startswith("skipped: no preset fits")


def test_a_fast_path_that_fell_back_during_the_checks_is_a_fail(monkeypatch):
    from server.kernels import compat
    from server.kernels.capabilities import capabilities
    from server.selfcheck.run import fallback_checks

    caps = capabilities("cpu")
    caps.runtime_failures.clear()

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(compat, "grouped_mm", broken)
    try:
        moe_check = next(c for c in kernel_pairs.kernel_checks(torch.device("cpu"), torch.float32, seed=1)
                         if c.name == "moe_experts")
        assert moe_check.status == PASS  # the reference path answered, and answered right
        (fallback,) = fallback_checks(caps)
        assert fallback.name == "grouped_mm" and fallback.status == FAIL and "no kernel for this shape" in fallback.detail
    finally:
        caps.runtime_failures.clear()
