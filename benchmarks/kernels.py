"""Kernel benchmarks for server/kernels on a CUDA GPU (imports only torch and server.kernels).

    PYTHONPATH=. python3 benchmarks/kernels.py [--json results.json] [--quick] [--no-compile]

Prints: the capability table; copy bandwidth (the roofline, measured in the same run); bf16 GEMV and FP8 linear
GB/s at LLM shapes; one Qwen3-30B-A3B MoE layer at 1 and 64 tokens, stage by stage, against a Python loop over
experts with host syncs; softmax + sampling over one [1, 128256] row; a sync check under
torch.cuda.set_sync_debug_mode("error"). Two timings per row: "graph" = many calls captured in one CUDA graph
and replayed (kernel time), "eager" = the same Python loop (includes CPU dispatch). Weights rotate over more
than the L2 so every call reads them from HBM.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.kernels import moe, moe_fp8, sampling
from server.kernels.capabilities import capabilities
from server.kernels.fp8 import fp8_linear, quantize_activation, quantize_fp8_rowwise
from server.kernels.linear import linear

ROTATE_BYTES = 256 * 2**20  # > 4x the H200's 60 MB L2
GEMV_SHAPES = [(2048, 2048), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
DEVICE = torch.device("cuda")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def time_eager(fn: Callable[[int], object], calls: int, reps: int = 5) -> float:
    """Microseconds per call of a Python loop of `calls` calls (CUDA events)."""
    for i in range(3):
        fn(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return median(times)


def time_graph(fn: Callable[[int], object], calls: int, reps: int = 10) -> float | str:
    """Microseconds per call with `calls` calls captured in one CUDA graph; a string when capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
    except Exception as exc:  # a host sync or an uncapturable op: report it, keep benchmarking
        torch.cuda.synchronize()
        return f"not capturable ({type(exc).__name__})"
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def best(*values) -> float:
    return min(v for v in values if isinstance(v, float))


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB -> 2 GiB device copy, bytes read + written."""
    src = torch.empty(2**30, dtype=torch.int16, device=DEVICE).random_()
    dst = torch.empty_like(src)
    micros = time_eager(lambda i: dst.copy_(src), calls=5)
    del src, dst
    return 2 * 2**31 / (micros * 1e-6) / 1e9


def bench_gemv(copy_gbps: float, rows: list[dict]) -> None:
    print("\n## GEMV, one token: y = x W^T (weight GB/s = stored weight bytes / time)")
    print("| W (N x K) | variant | graph us | eager us | weight GB/s | % of copy | x vs bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for num_out, num_in in GEMV_SHAPES:
        bf16_bytes = num_out * num_in * 2
        copies = max(2, math.ceil(ROTATE_BYTES / bf16_bytes))
        weights = [torch.randn(num_out, num_in, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies)]
        quant = [quantize_fp8_rowwise(w) for w in weights]
        x = torch.randn(1, 1, num_in, device=DEVICE, dtype=torch.bfloat16)
        x_fp8, x_scale = quantize_activation(x)
        ref = x.float().view(1, -1) @ weights[0].float().t()
        variants = {
            "bf16 F.linear": (lambda i: linear(x, weights[i % copies]), bf16_bytes, linear(x, weights[0])),
            "fp8 fp8_linear (x quantized once, outside)": (
                lambda i: fp8_linear(x_fp8, x_scale, *quant[i % copies], None, torch.bfloat16),
                num_out * num_in + num_out * 4,
                fp8_linear(x_fp8, x_scale, *quant[0], None, torch.bfloat16),
            ),
            "fp8 quantize_activation + fp8_linear": (
                lambda i: fp8_linear(*quantize_activation(x), *quant[i % copies], None, torch.bfloat16),
                num_out * num_in + num_out * 4,
                fp8_linear(*quantize_activation(x), *quant[0], None, torch.bfloat16),
            ),
        }
        bf16_graph = None
        for name, (fn, nbytes, out) in variants.items():
            graph_us, eager_us = time_graph(fn, calls=40), time_eager(fn, calls=40)
            fastest = best(graph_us, eager_us)
            bf16_graph = bf16_graph or graph_us
            gbps = nbytes / (fastest * 1e-6) / 1e9
            ratio = bf16_graph / graph_us if isinstance(graph_us, float) else float("nan")
            err = rel_err(out.view(1, -1), ref)
            print(f"| {num_out}x{num_in} | {name} | {fmt(graph_us)} | {fmt(eager_us)} | {gbps:.0f} | "
                  f"{100 * gbps / copy_gbps:.0f}% | {ratio:.2f} | {err:.1e} |")
            rows.append(dict(section="gemv", shape=[num_out, num_in], variant=name, graph_us=graph_us,
                             eager_us=eager_us, gbps=gbps, pct_copy=100 * gbps / copy_gbps, rel_err=err))
        del weights, quant
        torch.cuda.empty_cache()


def loop_experts(x, weights, expert_ids, gate_up, down):
    """The 2.14 way: per-expert counts to the host (.tolist()), then a Python loop over the experts hit."""
    num_experts = gate_up.shape[0]
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    order = torch.argsort(flat)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        tokens = slots // top_k
        y = F.linear(moe.swiglu(F.linear(x[tokens], gate_up[expert])), down[expert])
        out.index_add_(0, tokens, y * weights.reshape(-1)[slots, None])
    return out
