"""Decode KV write: two scatters per layer (K and V caches apart, today's layout) or one (K and V side by side
in one cache tensor)? Session 4's Llama breakdown counts 64 KV-write kernels per step (0.087 ms); one kernel per
layer would save about half, if inductor keeps the combined write in place (a write through a view of the
cache once made it copy the whole cache every step: docs/PERF.md).

    PYTHONPATH=. python3 benchmarks/kv_write.py [--batch 1] [--device cpu]   # cpu: a correctness smoke run

Each form ropes k (as the model does, so the write can fuse with it) and writes k and v of one layer (Llama-3.1-8B:
8 KV heads x 128, block 16), compiled; that compiled layer is called for `--layers` layers in one CUDA graph. One
call per layer, as in the model, where each layer's write sits between its own matmuls: session 5 compiled all
layers as one function, and inductor fused the separate writes of all 32 layers into a few kernels (0.14 us per
layer), which says nothing about the model. Prints one JSON line per form with us per layer and how far the first
layer's caches are from what the eager reference wrote (bf16 rounding).
"""

from __future__ import annotations

import argparse
import json

import torch

from server.bench.measure import cuda_graph_us
from server.kernels.paged_attention import write_kv
from server.models.layers import apply_rope

KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def separate(k, v, cos, sin, cache, slots):
    write_kv(cache, apply_rope(k, cos, sin), v, slots)  # cache: a (K, V) pair


def combined(k, v, cos, sin, kv_cache, slots):
    """kv_cache: [num_blocks, block, 2, kv_heads, head_dim], K at 0 and V at 1 of dim 2 (kv_layout "combined")."""
    write_kv(kv_cache, apply_rope(k, cos, sin), v, slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(args.batch, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    v = torch.randn(args.batch, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    angles = torch.rand(args.batch, HEAD_DIM // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    slots = (torch.randperm(args.num_blocks * BLOCK - BLOCK, generator=gen)[: args.batch] + BLOCK).to(device)
    shape = (args.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    reference = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))]
    separate(k, v, cos, sin, reference[0], slots)
    forms = {
        "separate": (separate, [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                                for _ in range(args.layers)]),
        "combined": (combined, [torch.zeros(args.num_blocks, BLOCK, 2, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
                                for _ in range(args.layers)]),
    }
    for name, (fn, caches) in forms.items():
        torch._dynamo.reset()
        one_layer = torch.compile(fn, fullgraph=True)

        def step(caches=caches, one_layer=one_layer):
            for cache in caches:
                one_layer(k, v, cos, sin, cache, slots)
        step()
        first = caches[0] if name == "separate" else (caches[0][:, :, 0], caches[0][:, :, 1])
        # compiled rope rounds once in fp32 where eager rounds per op in bf16: compare within bf16 rounding
        error = max((a.float() - b.float()).abs().max().item() for a, b in zip(first, reference[0], strict=True))
        record = {"form": name, "batch": args.batch, "layers": args.layers, "device": device.type,
                  "max_err_vs_eager": error, "matches_eager": error <= 3e-2}
        if device.type == "cuda":
            timed = cuda_graph_us(step, warmups=0, replays=50)
            record["us_per_layer"] = round(timed / args.layers, 2)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
