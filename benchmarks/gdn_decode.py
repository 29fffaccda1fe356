"""Gated DeltaNet decode: which compiled form moves the fp32 recurrent state fastest?

Session 4's Qwen3.6-35B-A3B breakdown (docs/PERF.md) found the decode update plus the gated output norm as one
inductor persistent-reduction kernel of 20.3 us per layer: ~4 MB of state read and written at ~200 GB/s. The
suspicion is a fusion across the output norm (a reduction over the value dim) that leaves one program per head.
Each form below takes the same inputs (Qwen3.6 shapes: 32 value heads, 16 key heads, dims 128) and returns the
normed, gated output, updating the state in place; it is compiled and timed for `--layers` layers (distinct
states, so the L2 cache does not hold them) in one CUDA graph:

  current     server.kernels.gated_delta.gated_delta_decode_ + GatedRMSNorm, as the model runs it: the state
              stored transposed, [dv, dk], so both products reduce over the contiguous dim (session 5)
  unfused     the same two steps compiled as two functions, so nothing of the norm can fuse into the update
  bmm         q and k against a [dk, dv] state as one batched matmul ([B*H, 2, dk] @ [B*H, dk, dv]), the
              update as one pointwise pass
  sk_layout   session 4's form: the state stored as [dk, dv], both products reducing over dk (strided)

    PYTHONPATH=. python3 benchmarks/gdn_decode.py [--batch 1] [--layers 30] [--device cpu]   # cpu: a smoke run

Prints one JSON line per form: us per layer, and the max error of output and state against the fp32
reference (`recurrent_gated_delta_step`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from server.bench.measure import cuda_graph_us
from server.kernels import gated_delta

HV, HK, DK, DV = 32, 16, 128, 128


def inputs(batch: int, device, gen: torch.Generator) -> dict:
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device)

    return dict(q=randn(batch, 1, HK, DK), k=randn(batch, 1, HK, DK), v=randn(batch, 1, HV, DV),
                g=-randn(batch, 1, HV).abs() * 0.1, beta=torch.rand(batch, 1, HV, generator=gen).to(device),
                z=randn(batch, HV, DV), weight=1 + randn(DV, scale=0.1))


def gated_norm(out, z, weight, eps=1e-6):
    """GatedRMSNorm of the model: (w * norm(out)) * silu(z), fp32 here (the inputs are fp32)."""
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed * F.silu(z)


def current(x, state_cache, slots):
    out = gated_delta.gated_delta_decode_(x["q"], x["k"], x["v"], x["g"], x["beta"], state_cache, slots)
    return gated_norm(out[:, 0], x["z"], x["weight"])


def bmm_form(x, state_cache, slots):
    q, k = gated_delta._normalize_qk(x["q"][:, 0], x["k"][:, 0], HV)  # [B, Hv, dk]
    batch = q.shape[0]
    v, beta = x["v"][:, 0].float(), x["beta"][:, 0].float()
    decay = x["g"][:, 0].float().exp()[..., None]  # [B, Hv, 1]
    state = state_cache[slots]  # [B, Hv, dk, dv]
    qk = torch.stack([q, k], dim=2).view(batch * HV, 2, DK)
    products = torch.bmm(qk, state.view(batch * HV, DK, DV)).view(batch, HV, 2, DV) * decay[..., None]
    seen, predicted = products[:, :, 0], products[:, :, 1]
    update = (v - predicted) * beta[..., None]
    out = seen + (q * k).sum(-1, keepdim=True) * update
    state_cache.index_put_((slots,), state * decay[..., None] + k[..., None] * update[..., None, :])
    return gated_norm(out, x["z"], x["weight"])


def sk_layout(x, state_cache, slots):
    """state_cache [slots, Hv, dk, dv]: S, both products reduce over dk, the strided dim (session 4's form)."""
    q, k = gated_delta._normalize_qk(x["q"][:, 0], x["k"][:, 0], HV)
    v, beta = x["v"][:, 0].float(), x["beta"][:, 0].float()
    decay = x["g"][:, 0].float().exp()[..., None]
    state = state_cache[slots]  # [B, Hv, dk, dv]
    predicted = (k[..., None] * state).sum(-2) * decay
    seen = (q[..., None] * state).sum(-2) * decay
    update = (v - predicted) * beta[..., None]
    out = seen + (q * k).sum(-1, keepdim=True) * update
    state_cache.index_put_((slots,), state * decay[..., None] + k[..., None] * update[..., None, :])
    return gated_norm(out, x["z"], x["weight"])


def reference(x, state):
    out, new_state = gated_delta.recurrent_gated_delta_step(x["q"], x["k"], x["v"], x["g"], x["beta"], state)
    return gated_norm(out[:, 0].float(), x["z"], x["weight"]), new_state


def run_form(name: str, batch: int, num_layers: int, device) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = inputs(batch, device, gen)
    num_slots = batch + 1
    states = [torch.randn(num_slots, HV, DK, DV, generator=gen).to(device) * 0.1 for _ in range(num_layers)]
    slots = torch.arange(1, batch + 1, device=device)
    expected_out, expected_state = reference(x, states[0][slots])
    is_transposed = name in ("current", "unfused")  # the model's layout: S^T
    caches = [s.transpose(-1, -2).contiguous() for s in states] if is_transposed else [s.clone() for s in states]
    if name == "unfused":
        update = torch.compile(lambda x, c, s: gated_delta.gated_delta_decode_(x["q"], x["k"], x["v"], x["g"],
                                                                                x["beta"], c, s), fullgraph=True)
        norm = torch.compile(gated_norm, fullgraph=True)

        def one(x, cache, slots):
            return norm(update(x, cache, slots)[:, 0], x["z"], x["weight"])
    else:
        one = torch.compile({"current": current, "bmm": bmm_form, "sk_layout": sk_layout}[name], fullgraph=True)
    out = one(x, caches[0], slots)
    new_state = caches[0][slots].transpose(-1, -2) if is_transposed else caches[0][slots]
    record = {"form": name, "batch": batch, "device": device.type,
              "max_err_out": (out - expected_out).abs().max().item(),
              "max_err_state": (new_state - expected_state).abs().max().item()}
    step = lambda: [one(x, cache, slots) for cache in caches]  # noqa: E731
    if device.type == "cuda":
        record["us_per_layer"] = round(cuda_graph_us(step) / num_layers, 2)
    else:
        begin = time.perf_counter()
        step()
        record["us_per_layer_cpu"] = round((time.perf_counter() - begin) * 1e6 / num_layers, 1)
    record["state_mb_per_layer"] = round(batch * HV * DK * DV * 4 / 1e6, 2)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--forms", default="current,unfused,bmm,sk_layout")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    for name in args.forms.split(","):
        torch._dynamo.reset()
        try:
            print(json.dumps(run_form(name, args.batch, args.layers, device)), flush=True)
        except Exception as exc:  # noqa: BLE001 - one form failing must not hide the others
            print(json.dumps({"form": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)


if __name__ == "__main__":
    main()
