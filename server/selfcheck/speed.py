"""The speeds that decide how well this machine serves: copy bandwidth (the roofline every decode figure is a
fraction of), GEMV through F.linear in bf16 and in FP8 (the decode step's dense layers), and one MoE
layer on the sync-free path against the host-synced loop twin. Measurements pass when they run and give
finite, positive rates; slow is reported, not failed (there is no bound a user's machine must reach)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.bench import measure
from server.kernels import fp8, moe
from server.kernels.capabilities import capabilities
from server.kernels.plan import step_plan
from server.selfcheck.results import FAIL, PASS, SKIP, Check, attempt

SECTION = "speed"
ROTATE_BYTES = 256 << 20  # GEMV weights rotate over more than any cache, so timings see memory


@dataclass(frozen=True)
class SpeedSizes:
    copy_mib: int
    gemv_shapes: tuple[tuple[int, int], ...]  # (out_features, in_features)
    moe_shape: tuple[int, int, int, int]  # (num_experts, top_k, hidden, moe_intermediate)
    reps: int


FULL = SpeedSizes(1024, ((4096, 4096), (14336, 4096), (4096, 14336)), (128, 8, 2048, 768), 5)  # Qwen3-30B-A3B MoE
QUICK = SpeedSizes(64, ((1024, 1024), (4096, 1024)), (16, 2, 256, 128), 3)


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, inner: int = 10) -> float:
    """Seconds per call of fn: the median over `reps` timings of `inner` calls, after one warm-up call."""
    fn()
    times = sorted(measure.timed(lambda: [fn() for _ in range(inner)], device)[0] / inner for _ in range(reps))
    return times[len(times) // 2]


def speed_checks(device: torch.device, dtype: torch.dtype, sizes: SpeedSizes) -> tuple[list[Check], float | None]:
    """The checks and the copy bandwidth in GB/s (None when it could not be measured)."""
    copy = attempt(SECTION, "copy_bandwidth", lambda: check_copy(device, sizes.copy_mib))
    copy_gb_s = copy.values.get("gb_s")
    checks = [copy]
    for shape in sizes.gemv_shapes:  # in bf16, the checkpoints' dtype, whatever the device serves in
        for quantized in (False, True):
            name = f"gemv_{'fp8' if quantized else 'bf16'}_{shape[0]}x{shape[1]}"
            checks.append(attempt(SECTION, name, lambda s=shape, q=quantized, n=name: check_gemv(
                device, torch.bfloat16, s, q, sizes.reps, copy_gb_s, n)))
    checks.append(attempt(SECTION, "moe_layer", lambda: check_moe_layer(device, dtype, sizes.moe_shape, sizes.reps)))
    return checks, copy_gb_s


def _rate(name: str, gb_s: float, detail: str, values: dict) -> Check:
    ok = math.isfinite(gb_s) and gb_s > 0
    return Check(SECTION, name, PASS if ok else FAIL, detail, {"gb_s": gb_s, **values})


def check_copy(device: torch.device, copy_mib: int) -> Check:
    gb_s = measure.copy_bandwidth_gb_s(device, copy_mib << 20)
    return _rate("copy_bandwidth", gb_s, f"{gb_s:.1f} GB/s (read + write, {copy_mib} MiB buffers)",
                 {"copy_mib": copy_mib})


def check_gemv(device, dtype, shape: tuple[int, int], quantized: bool, reps: int, copy_gb_s: float | None,
               name: str) -> Check:
    """One token through F.linear (or quantize + FP8 row-wise linear); GB/s of weight bytes read."""
    out_features, in_features = shape
    if quantized and not capabilities(device).fp8_rowwise.ok:
        return Check(SECTION, name, SKIP, "no row-wise FP8 scaled_mm on this device (see the capabilities); "
                     "--quantize fp8 runs the dequantizing reference here")
    generator = torch.Generator().manual_seed(0)
    weight_bytes = out_features * in_features * (1 if quantized else dtype.itemsize)
    num_copies = 1 if device.type == "cpu" else max(1, min(32, ROTATE_BYTES // weight_bytes))
    x = torch.randn(1, in_features, generator=generator).to(device, dtype)
    weights = [torch.randn(out_features, in_features, generator=generator).to(device, dtype) for _ in range(num_copies)]
    calls = iter(range(1 << 62))
    if quantized:
        weights = [fp8.quantize_fp8_rowwise(w) for w in weights]
        plan = step_plan(device, dtype)

        def step():
            w_fp8, w_scale = weights[next(calls) % num_copies]
            return fp8.fp8_linear(*fp8.quantize_activation(x), w_fp8, w_scale, None, dtype, plan)
    else:

        def step():
            return F.linear(x, weights[next(calls) % num_copies])

    seconds = median_seconds(step, device, reps)
    gb_s = weight_bytes / seconds / 1e9
    fraction = f", {gb_s / copy_gb_s:.0%} of copy bandwidth" if copy_gb_s else ""
    return _rate(name, gb_s, f"{gb_s:.1f} GB/s{fraction} ({seconds * 1e6:.0f} us per call)",
                 {"seconds": seconds, "weight_bytes": weight_bytes})


def check_moe_layer(device, dtype, shape: tuple[int, int, int, int], reps: int) -> Check:
    """One token through one MoE layer: the engine's sync-free experts path vs the host-synced loop twin."""
    num_experts, top_k, hidden, inter = shape
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5).to(device, dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5).to(device, dtype)
    x = torch.randn(1, hidden, generator=generator).to(device, dtype)
    plan = step_plan(device, dtype)
    weights, expert_ids = moe.route_softmax(torch.randn(1, num_experts, generator=generator).to(device, dtype),
                                            top_k, True, plan)
    fast_s = median_seconds(lambda: moe.moe_experts(x, weights, expert_ids, gate_up, down, plan), device, reps)
    loop_s = median_seconds(lambda: moe.moe_experts_reference(x, weights, expert_ids, gate_up, down), device, reps)
    path = "grouped_mm" if plan.grouped_mm else "gather + bmm (no grouped_mm for this dtype here)"
    ok = all(math.isfinite(s) and s > 0 for s in (fast_s, loop_s))
    detail = (f"{path}: {fast_s * 1e3:.3f} ms vs host-synced loop {loop_s * 1e3:.3f} ms "
              f"({loop_s / fast_s:.1f}x), E={num_experts} k={top_k} H={hidden} I={inter}, batch 1")
    return Check(SECTION, "moe_layer", PASS if ok else FAIL, detail,
                 {"fast_s": fast_s, "loop_s": loop_s, "speedup": loop_s / fast_s, "path": path})
