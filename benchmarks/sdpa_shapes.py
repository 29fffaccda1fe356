"""What a prefill step's first call with a new shape costs, per SDPA backend and for the GEMMs (session 7).

The SSE timelines showed each new prefill step composition 40-80 ms slower once (a host-side cost that a repeat of
the same shapes does not pay). This times, per backend, the first and the second call of SDPA on fresh shapes as
the engine's two prefill forms make them (causal GQA over one prompt; a boolean-masked padded batch), and a linear
layer on a fresh token count. One JSON line per (form, backend): median first-call and repeat ms over the shapes;
a last line times a linear layer over `--sweep` fresh token counts in a row (run it again with
CUDA_MODULE_LOADING=EAGER to tell lazy kernel loading from a per-shape cost).

    python benchmarks/sdpa_shapes.py [--shapes 6] [--sweep 48]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096  # the Llama-3.1-8B attention and projection shapes


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def causal_call(seq_len: int):
    q = torch.randn(1, HEADS, seq_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def masked_call(seq_len: int):
    num_seqs, kv_len = 5, seq_len + 64
    q = torch.randn(num_seqs, HEADS, seq_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(num_seqs, HEADS, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(num_seqs, 1, seq_len, kv_len, device="cuda") < 0.9
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def linear_call(num_tokens: int):
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return lambda: F.linear(x, weight)


BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def measure(form: str, make, backend: str, sizes: list[int]) -> dict:
    firsts, repeats = [], []
    for size in sizes:
        call = make(size)
        chosen = contextlib.nullcontext() if BACKENDS.get(backend) is None else sdpa_kernel(BACKENDS[backend])
        try:
            with chosen:
                firsts.append(timed(call))
                repeats.append(timed(call))
        except RuntimeError as error:  # the backend does not take this form
            return {"form": form, "backend": backend, "error": str(error).splitlines()[0][:120]}
    return {"form": form, "backend": backend, "first_ms": round(statistics.median(firsts), 3),
            "repeat_ms": round(statistics.median(repeats), 3), "first_ms_each": [round(t, 2) for t in firsts]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", type=int, default=48, help="fresh token counts for the linear sweep")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    timed(masked_call(32))  # context and library start-up out of the way
    timed(causal_call(32))
    for form, make in (("causal_gqa", causal_call), ("masked", masked_call), ("linear", linear_call)):
        for backend in (["default"] if form == "linear" else list(BACKENDS)):
            # fresh sizes for every backend, so that no backend meets a shape another one has cached
            sizes = torch.randint(100, 600, (args.shapes,), generator=generator).tolist()
            print(json.dumps({"torch": torch.__version__, **measure(form, make, backend, sizes)}), flush=True)
    # Does a new token count keep costing the GEMMs (a per-shape choice) or less and less (kernels loaded once)?
    sizes = torch.randperm(2048, generator=generator)[: args.sweep].add(1).tolist()
    record = measure("linear_sweep", linear_call, "default", sizes)
    print(json.dumps({"torch": torch.__version__, "sizes": sizes, **record}), flush=True)


if __name__ == "__main__":
    main()
