"""Batch-1 GEMV time of the Llama-3.1-8B projections under each BLAS backend torch offers on CUDA, and the
fraction of copy bandwidth each reaches (a layer's weights are read once per token).

    PYTHONPATH=. python3 benchmarks/gemv_backends.py

Each shape runs 20 times in one CUDA graph (distinct weights, so nothing stays in L2), timed over 20 replays.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from server.bench.measure import cuda_graph_us

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS = 20


def copy_gb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_graph_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def main():
    copy = copy_gb_s()
    print(json.dumps({"copy_gb_s": round(copy, 1)}), flush=True)
    for name, (out_features, in_features) in SHAPES.items():
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name}
        for backend in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(backend)
            us = cuda_graph_us(lambda x=x, weights=weights: [F.linear(x, w) for w in weights]) / CALLS
            row[backend] = {"us": round(us, 2), "of_copy": round(2 * out_features * in_features / us / 1e3 / copy, 3)}
        torch.backends.cuda.preferred_blas_library("cublas")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
