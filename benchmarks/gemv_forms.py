"""Few-token GEMV forms for the Llama-3.1-8B projections: cuBLAS behind `F.linear` (what the compiled decode
step calls today), inductor's GEMM autotuning (Triton templates against cuBLAS), and the GEMV written as a
multiply-and-sum that inductor lowers to one Triton reduction kernel (no split-K reduce kernel after it); the
norm_* forms put an RMSNorm before the GEMV, which inductor may fuse in. Session 4 put qkv and o_proj at 71-74% of
copy speed against 93% for gate_up / down, plus 64 split-K reduce kernels per step: ~0.3 ms of a 4.6 ms Llama
step. Results: docs/PERF.md, session 8.

    PYTHONPATH=. python3 benchmarks/gemv_forms.py [--batches 1,2,4] [--forms blas,reduction,...] [--device cpu]

Each shape runs `--calls` times in one CUDA graph with distinct weights (nothing stays in L2); one JSON line per
(shape, batch) with us per call, the fraction of copy bandwidth (weight bytes only) and the max error against
an fp32 `F.linear` of the same bf16 operands. `--device cpu` is a correctness smoke run (no timing).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from server.bench.measure import copy_bandwidth_gb_s, cuda_graph_us

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def blas(x, w):
    return F.linear(x, w)


def reduction(x, w):
    """[B, K] x [N, K] -> [B, N] as one reduction over K; inductor accumulates bf16 products in fp32."""
    return (x.unsqueeze(-2) * w).sum(-1)


def reduction_fp32(x, w):
    return (x.float().unsqueeze(-2) * w.float()).sum(-1).to(x.dtype)


def norm_blas(x, w, norm_weight):
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm_weight, 1e-5), w)


def norm_reduction(x, w, norm_weight):
    return reduction(F.rms_norm(x, (x.shape[-1],), norm_weight, 1e-5), w)


FORMS = {
    "blas": (blas, None),
    "inductor": (blas, {}),
    "autotune": (blas, {"mode": "max-autotune-no-cudagraphs"}),
    "reduction": (reduction, {}),
    "reduction_fp32": (reduction_fp32, {}),
    "norm_blas": (norm_blas, {}),
    "norm_reduction": (norm_reduction, {}),
}


def time_form(name, x, weights, norm_weight, device) -> tuple[float | None, torch.Tensor]:
    fn, compile_kwargs = FORMS[name]
    if compile_kwargs is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, dynamic=False, **compile_kwargs)
    args = (norm_weight,) if name.startswith("norm_") else ()
    out = fn(x, weights[0], *args)
    if device.type != "cuda":
        return None, out
    us = cuda_graph_us(lambda: [fn(x, w, *args) for w in weights]) / len(weights)
    return us, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    calls = args.calls if device.type == "cuda" else 1
    copy = copy_bandwidth_gb_s(device, 1 << 30) if device.type == "cuda" else None
    if copy is not None:
        print(json.dumps({"copy_gb_s": round(copy, 1), "torch": torch.__version__}), flush=True)
    for shape, (out_features, in_features) in SHAPES.items():
        weights = [torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02 for _ in range(calls)]
        norm_weight = torch.rand(in_features, device=device, dtype=dtype) + 0.5
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, in_features, device=device, dtype=dtype)
            normed = F.rms_norm(x.float(), (in_features,), norm_weight.float(), 1e-5).to(dtype)
            row = {"shape": shape, "batch": batch}
            for name in args.forms.split(","):
                us, out = time_form(name, x, weights, norm_weight, device)
                reference = F.linear((normed if name.startswith("norm_") else x).float(), weights[0].float())
                row[name] = {"max_err": round((out.float() - reference).abs().max().item(), 5)}
                if us is not None:
                    row[name] |= {"us": round(us, 2), "of_copy": round(2 * out_features * in_features / us / 1e3 / copy, 3)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
