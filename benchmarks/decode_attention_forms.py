"""Decode attention's GQA in its two SDPA forms side by side: each KV head's query group folded into SDPA's query
axis (the engine's form) against every KV head repeated for its query group (`repeat_interleave`, a copy of K/V per
step) before SDPA. The repeated run replaces `paged_attention.attention_reference` in this process only: a
measurement, not a setting.

    PYTHONPATH=. python3 benchmarks/decode_attention_forms.py --op --device cpu
    PYTHONPATH=. python3 benchmarks/decode_attention_forms.py -- --preset llama-3.1-8b --batch-sizes 16 --graphs on

--op times the decode attention alone (gathered blocks, compiled with dynamic shapes, Qwen3-30B-A3B's heads by
default) at a few context lengths. Otherwise the arguments after `--` go to `mps-serve bench`, run once per form
of --forms in one process (a flex batch-1 step on CUDA is the same in every run).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from server import cli
from server.engine import saved_compile
from server.kernels import paged_attention


def repeated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    num_groups = q.shape[1] // k.shape[1]
    if num_groups > 1:
        k, v = k.repeat_interleave(num_groups, dim=1), v.repeat_interleave(num_groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def time_ops(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, batch: int, contexts: list[int], reps: int) -> None:
    block_size = 16
    folded = paged_attention.attention_reference
    for context in contexts:
        num_blocks = context // block_size
        gen = torch.Generator().manual_seed(context)
        k_cache, v_cache = (torch.randn(batch * num_blocks + 1, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
                            for _ in range(2))
        tables = (torch.randperm(batch * num_blocks, generator=gen) + 1).view(batch, num_blocks).to(device)
        positions = torch.full((batch,), context - 3, device=device)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
        args = (q, k_cache, v_cache, tables, positions, head_dim**-0.5)
        reference = None
        for name, form in (("folded", folded), ("repeated", repeated_attention)):
            paged_attention.attention_reference = form
            torch._dynamo.reset()
            step = torch.compile(paged_attention.gathered_decode_attention, dynamic=True)
            out = step(*args)
            reference = out if reference is None else reference
            error = (out - reference).float().abs().max().item()
            _sync(device)
            start = time.perf_counter()
            for _ in range(reps):
                step(*args)
            _sync(device)
            micros = (time.perf_counter() - start) / reps * 1e6
            print(f"{device} {dtype} batch {batch} context {context:6d}  {name:9s} {micros:9.1f} us  max diff {error:.1e}")
    paged_attention.attention_reference = folded


def _sync(device: str) -> None:
    if device != "cpu":
        getattr(torch, device).synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="store_true", help="time the attention alone instead of the engine")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", default="256,2048", help="comma-separated KV lengths (multiples of 16)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--forms", default="folded,repeated", help="which forms run end to end, in this order")
    parser.add_argument("bench_args", nargs="*", help="after --: mps-serve bench's arguments")
    args = parser.parse_args(argv)
    if args.op:
        contexts = [int(n) for n in args.contexts.split(",")]
        time_ops(args.device, getattr(torch, args.dtype), args.heads, args.kv_heads, args.head_dim, args.batch, contexts, args.reps)
        return 0
    saved_compile.saves_compiles = lambda: False  # else the second run would load the first one's step (same sources)
    folded, status = paged_attention.attention_reference, 0
    for form in args.forms.split(","):
        paged_attention.attention_reference = {"folded": folded, "repeated": repeated_attention}[form]
        print(f"== decode attention, GQA {form}", flush=True)
        status = status or cli.main(["bench", *args.bench_args])
    return status


if __name__ == "__main__":
    sys.exit(main())
