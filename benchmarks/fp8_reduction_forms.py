"""FP8 weight-only decode reductions at one token, op by op, beside their bf16 forms: a MoE layer's experts
(gate/up with SwiGLU, down with the routing-weighted combine) and the lm_head, at Qwen3-30B-A3B's widths by default.
Each form is compiled alone and timed as CUDA-graph replays of one call per layer copy (the copies and fresh
expert ids keep the weights out of L2), so the figure is device time, not launch cost; `ideal` is the weight bytes
over a device-to-device copy's bandwidth measured here. Forms marked `+cdt` compile with inductor's coordinate
descent tuning of block sizes.

    PYTHONPATH=. python3 benchmarks/fp8_reduction_forms.py            # CUDA
    PYTHONPATH=. python3 benchmarks/fp8_reduction_forms.py --device cpu --layers 2 --experts 8 --hidden 64 \
        --inter 32 --vocab 256 --reps 2                               # a smoke run of the script

The engine compiles a model with FP8 linears with the tuning on CUDA (compat.tune_generated_kernels); the untuned
forms are what inductor emits without it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels import time_graph
from server.bench.measure import copy_bandwidth_gb_s
from server.kernels import moe, moe_fp8
from server.kernels.fp8 import fp8_linear, fp8_weight_only_linear, quantize_activation, quantize_fp8_rowwise
from server.kernels.plan import step_plan


def down_upcast_bf16(x, weights, expert_ids, gate_up_q, gate_up_scale, down_q, down_scale):
    """The engine's FP8 form with every FP8 weight converted to bf16 before float32 (the hardware's FP8 -> bf16
    conversion where it has one)."""
    return moe_fp8._experts_gather_reduce_fp8(x, weights, expert_ids, gate_up_q.to(torch.bfloat16), gate_up_scale,
                                              down_q.to(torch.bfloat16), down_scale)


def outer_fp8(x, weights, expert_ids, gate_up_t, gate_up_scale, down_t, down_scale):
    """Both expert projections with their weights stored transposed (gate_up_t [E, H, 2I], down_t [E, I, H]): each
    reduction runs over rows of the output's contiguous width, so a block of outputs reads one contiguous run of
    bytes per reduction step and the gather's index math is paid per row, not per element."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    x_slots = moe.token_slots(x, top_k).float().unsqueeze(-1)  # [T*k, H, 1]
    inter = gate_up_t.shape[-1] // 2
    gate, up = ((gate_up_t[:, :, rows][flat_ids].float() * x_slots).sum(1) * gate_up_scale[:, rows][flat_ids]
                for rows in (slice(0, inter), slice(inter, None)))  # [T*k, I] each
    return down_outer(F.silu(gate) * up, weights, flat_ids, down_t, down_scale).to(x.dtype)


def down_outer_fp8(x, weights, expert_ids, gate_up_q, gate_up_scale, down_t, down_scale):
    """The engine's gate/up, then the down reduction over down_t [E, I, H] (stored transposed) as outer_fp8's."""
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    act = moe.slot_swiglu(gate_up_q, flat_ids, moe.token_slots(x, expert_ids.shape[1]).unsqueeze(1), gate_up_scale)
    return down_outer(act, weights, flat_ids, down_t, down_scale).to(x.dtype)


def down_outer(act, weights, flat_ids, down_t, down_scale):
    """sum over slots j and i of weights[j] * act[j, i] * down_t[id_j, i, h] * scale[id_j, h] -> [T, H] float32."""
    num_tokens, top_k = weights.shape
    weighted_act = (act.float() * weights.reshape(-1, 1).float()).unsqueeze(-1)  # [T*k, I, 1]
    products = down_t[flat_ids].float() * down_scale[flat_ids].unsqueeze(1) * weighted_act  # [T*k, I, H]
    return products.view(num_tokens, top_k, *products.shape[1:]).sum(dim=(1, 2))


def down_transposed(call: tuple) -> tuple:
    """An FP8 call with the down weights stored transposed: [E, H, I] -> [E, I, H]."""
    return (*call[:5], call[5].transpose(1, 2).contiguous(), call[6])


def transposed(call: tuple) -> tuple:
    """An FP8 call with both expert weights stored transposed: gate_up [E, 2I, H] -> [E, H, 2I], down as above."""
    call = down_transposed(call)
    return (*call[:3], call[3].transpose(1, 2).contiguous(), *call[4:])


def gate_up_only(x, weights, expert_ids, gate_up, *scale_and_down):
    """The first of the two expert kernels alone: silu(gate) * up per slot -> [T*k, I]."""
    scale = scale_and_down[0] if len(scale_and_down) == 3 else None
    return moe.slot_swiglu(gate_up, expert_ids.reshape(-1), moe.token_slots(x, expert_ids.shape[1]).unsqueeze(1), scale)


def then_add_and_norm(experts):
    """The experts as a decoder layer ends with them: the residual add (x standing in for the residual) and the
    next layer's RMSNorm, so a form's last step can fuse into that kernel -> (residual [T, H], normed [T, H])."""
    def form(x, *rest):
        residual = x + experts(x, *rest)
        return residual, F.rms_norm(residual, residual.shape[-1:], None, 1e-6)
    return form


def expert_forms() -> dict:
    """name -> (takes FP8 weights, form, compiled with coordinate descent tuning too, the call's weights as the
    form stores them)."""
    same = None
    return {
        "bf16": (False, moe._experts_gather_reduce, True, same),
        "bf16 gate/up only": (False, gate_up_only, False, same),
        "fp8": (True, moe_fp8._experts_gather_reduce_fp8, True, same),
        "fp8 gate/up only": (True, gate_up_only, True, same),
        "fp8 via bf16": (True, down_upcast_bf16, False, same),
        "fp8 down transposed": (True, down_outer_fp8, True, down_transposed),
        "fp8 both transposed": (True, outer_fp8, True, transposed),
        "bf16 +add&norm": (False, then_add_and_norm(moe._experts_gather_reduce), True, same),
        "fp8 +add&norm": (True, then_add_and_norm(moe_fp8._experts_gather_reduce_fp8), True, same),
    }


def lm_head_forms(plan) -> dict:
    """`plan`: the compiled step's plan on the device (scaled_mm's spelling and fallback)."""
    return {
        "bf16 F.linear": (False, lambda x, w, s: F.linear(x, w)),
        "fp8 weight-only": (True, lambda x, w, s: fp8_weight_only_linear(x, w, s, None, x.dtype)),
        "fp8 scaled_mm": (True, lambda x, w, s: fp8_linear(*quantize_activation(x), w, s, None, x.dtype, plan)),
    }


def device_micros(device: str, fn, calls: list[tuple], reps: int) -> float:
    """Device time per call: on CUDA the calls captured in one graph and replayed (benchmarks/kernels.py), else
    wall time."""
    if device == "cuda":
        micros = time_graph(lambda i: fn(*calls[i % len(calls)]), len(calls), reps)
        if isinstance(micros, str):
            raise RuntimeError(micros)
        return micros
    start = time.perf_counter()
    for _ in range(reps):
        for args in calls:
            fn(*args)
    return (time.perf_counter() - start) / reps / len(calls) * 1e6


def compiled(fn, tuned: bool):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True} if tuned else None)


def run_experts(args, device: str, dtype: torch.dtype, gbps: float) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    num_experts, hidden, inter, k = args.experts, args.hidden, args.inter, args.top_k
    layers = []
    for _ in range(args.layers):
        gate_up = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * hidden**-0.5
        down = torch.randn(num_experts, hidden, inter, device=device, dtype=dtype, generator=gen) * inter**-0.5
        layers.append((gate_up, down, *moe_fp8.quantize_experts(gate_up), *moe_fp8.quantize_experts(down)))
    calls = []
    for gate_up, down, gate_up_q, gate_up_scale, down_q, down_scale in layers:
        x = torch.randn(1, hidden, device=device, dtype=dtype, generator=gen)
        expert_ids = torch.randperm(num_experts, device=device, generator=gen)[:k].view(1, k)
        weights = torch.softmax(torch.randn(1, k, device=device, generator=gen), -1).to(dtype)
        calls.append(((x, weights, expert_ids, gate_up, down), (x, weights, expert_ids, gate_up_q, gate_up_scale,
                                                                 down_q, down_scale)))
    reference = moe_fp8.moe_experts_fp8_reference(*calls[0][1]).float()
    for name, (is_fp8, form, tune_too, stored_as) in expert_forms().items():
        if args.match and args.match not in name:
            continue
        form_calls = [call[1] if is_fp8 else call[0] for call in calls]
        form_calls = form_calls if stored_as is None else [stored_as(call) for call in form_calls]
        for tuned in (False, True) if tune_too else (False,):
            fn = compiled(form, tuned)
            out = fn(*form_calls[0])
            # an add&norm form: its residual less x is the experts' output
            out = out[0].float() - form_calls[0][0].float() if isinstance(out, tuple) else out.float()
            error = (out - reference).abs().max().item() if out.shape == reference.shape else float("nan")
            micros = device_micros(device, fn, form_calls, args.reps)
            weight_bytes = (2 if "gate/up" in name else 3) * k * hidden * inter * (1 if is_fp8 else dtype.itemsize)
            report(f"experts {name}{' +cdt' if tuned else ''}", micros, weight_bytes, gbps, error)


def run_lm_head(args, device: str, dtype: torch.dtype, gbps: float) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=gen) * args.hidden**-0.5
    weight_q, weight_scale = quantize_fp8_rowwise(weight)
    x = torch.randn(1, args.hidden, device=device, dtype=dtype, generator=gen)
    reference = x.float() @ (weight_q.float() * weight_scale).t()
    for name, (is_fp8, form) in lm_head_forms(step_plan(device, dtype, traced=True)).items():
        for tuned in (False, True) if "weight-only" in name else (False,):
            fn = compiled(form, tuned)
            call = (x, weight_q, weight_scale) if is_fp8 else (x, weight, None)
            error = (fn(*call).float() - reference).abs().max().item()
            micros = device_micros(device, fn, [call] * 4, args.reps)
            report(f"lm_head {name}{' +cdt' if tuned else ''}", micros, weight.numel() * (1 if is_fp8 else dtype.itemsize),
                   gbps, error)


def report(name: str, micros: float, weight_bytes: int, gbps: float, error: float) -> None:
    ideal = weight_bytes / gbps / 1e3
    print(f"{name:42s} {micros:9.1f} us  ideal {ideal:8.1f} us  {ideal / micros:6.1%}  max err {error:.3g}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=16, help="layer copies per graph (keeps weights out of L2)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", choices=["experts", "lm_head"], default=None)
    parser.add_argument("--match", default=None, help="only the expert forms whose name contains this, e.g. add&norm")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gbps = copy_bandwidth_gb_s(torch.device(args.device), 4 << 30 if args.device == "cuda" else 256 << 20)  # as the bench
    print(f"torch {torch.__version__} on {args.device}, {dtype}; copy {gbps:.0f} GB/s", flush=True)
    if args.only in (None, "experts"):
        run_experts(args, args.device, dtype, gbps)
    if args.only in (None, "lm_head"):
        run_lm_head(args, args.device, dtype, gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
