"""Per-layer choice between FP8 and the model dtype, decided by timing both on the device in hand.

`quantization="fp8"` promises half the weight bytes, so a layer may stay in the model dtype only where FP8
measured slower *and* such layers stay under `keep_budget` of all weight bytes. Row-wise FP8 tends to lose on
small square projections, where the activation quantization is not paid back, and win on large ones.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from server.kernels.compat import synchronize
from server.kernels.fp8 import fp8_linear, quantize_activation, quantize_fp8_rowwise

_ROTATE_BYTES = 128 * 2**20  # weights rotate over more than a GPU's L2, so timings see memory, not cache


def _median_seconds(fn: Callable[[int], object], device: torch.device, reps: int) -> float:
    fn(0)  # warm-up: kernel selection, lazy init
    times = []
    for rep in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn(rep)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@functools.cache
def fp8_speedup(device_name: str, out_features: int, in_features: int, dtype: torch.dtype, reps: int = 5) -> float:
    """(model-dtype F.linear time) / (quantize activation + fp8_linear time) for one token; > 1: FP8 is faster."""
    device = torch.device(device_name)
    weight_bytes = out_features * in_features * torch.finfo(dtype).bits // 8
    num_copies = 1 if device.type == "cpu" else max(1, min(32, _ROTATE_BYTES // weight_bytes))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, in_features, generator=generator).to(device, dtype)
    dense = [torch.randn(out_features, in_features, generator=generator).to(device, dtype) for _ in range(num_copies)]
    quant = [quantize_fp8_rowwise(w) for w in dense]
    inner = 10

    def run_dense(rep: int) -> None:
        for i in range(inner):
            F.linear(x, dense[(rep * inner + i) % num_copies])

    def run_fp8(rep: int) -> None:
        for i in range(inner):
            w_fp8, w_scale = quant[(rep * inner + i) % num_copies]
            fp8_linear(*quantize_activation(x), w_fp8, w_scale, None, dtype)

    return _median_seconds(run_dense, device, reps) / _median_seconds(run_fp8, device, reps)


def plan_fp8_layers(
    layer_shapes: Mapping[str, tuple[int, int]],  # layer name -> (out_features, in_features)
    device: torch.device | str,
    dtype: torch.dtype,
    total_weight_bytes: int,  # all weights of the model as they will be stored (FP8 linears counted at 1 B/elem)
    keep_budget: float = 0.05,
) -> set[str]:
    """Names of the layers to keep in the model dtype: FP8 measured slower there, worst first, within the budget."""
    device_name = str(torch.device(device))
    itemsize = torch.finfo(dtype).bits // 8
    speedups = {shape: fp8_speedup(device_name, *shape, dtype) for shape in set(layer_shapes.values())}
    slower = sorted((speedups[shape], name) for name, shape in layer_shapes.items() if speedups[shape] < 1.0)
    kept, kept_bytes = set(), 0
    for _, name in slower:
        out_features, in_features = layer_shapes[name]
        layer_bytes = out_features * in_features * itemsize  # as kept, in the model dtype
        if kept_bytes + layer_bytes > keep_budget * total_weight_bytes:
            continue
        kept.add(name)
        kept_bytes += layer_bytes
    return kept
