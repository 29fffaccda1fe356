"""Per-token decode time by kind of kernel, kernels launched per step, and the gaps between them.

    PYTHONPATH=. python3 benchmarks/decode_breakdown.py --preset qwen3-30b-a3b [--graphs 0]
    PYTHONPATH=. python3 benchmarks/decode_breakdown.py --preset qwen3.6-35b-a3b [--quantize fp8]
    PYTHONPATH=. python3 benchmarks/decode_breakdown.py --preset qwen3-30b-a3b --num-layers 4 --list-step

--num-layers N keeps the first N layers (full widths: per-layer figures for a fraction of the compile);
--list-step prints the kernels of the last profiled step in launch order, one line each (what one layer runs).
--prefill profiles `--steps` prefills of `--prompt-len` tokens instead (one fresh prompt each, to its first token):
the same table for a prefill, e.g. FP8 against bf16 at short prompts.

Runs the compiled engine (CUDA graphs by default), profiles `--steps` steady decode steps with torch.profiler (the
prefill and the first decode step run before the profile; `--max-num-seqs 1 --eager-prefill` compile only the
one-sequence step, a listing's quick form)
and classifies every GPU kernel by name (regexes below; inductor names kernels after the ops it fused, so a
fused kernel lands in the first category whose pattern it matches; `top_kernels` lists the biggest by name).
gaps = wall time per step - kernel time; under the profiler the host side is several times slower, so the wall
time (and the gaps) are the profiler's, while kernel times are the device's own (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from server.bench.measure import synchronize
from server.bench.presets import load_preset, with_num_layers
from server.bench.random_model import build_random_model
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams

CATEGORIES = [  # (name, pattern on the kernel name), first match wins
    # The compiled decode step's expert matvecs are inductor reductions named after the gather they fuse
    # (`..._index_mul_silu_..._sum`, `..._expand_index_mul_sum_...`); the weighted combine is a bmm.
    ("moe experts", r"red_fused.*index.*(silu|mul_sum)|grouped|gather.*silu|silu.*gather|bmm"),
    ("kv write", r"index_put|index_copy"),
    ("attention", r"attention|sdpa|fmha|flash|_efficient_|softmax.*(bitwise|masked)|masked_fill"),
    ("moe routing", r"topk|sort|searchsorted|sigmoid.*add|softmax"),
    ("gemm / gemv", r"nvjet|gemm|gemv|cutlass|splitK|cublas|sm90_xmma|mm_"),
    ("norms / rope / act", r"rsqrt|mean|cos|sin|silu|mul|add"),
    ("sampling", r"argmax|exponential|log|cumsum|scatter"),
]


def classify(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="a bench preset name or .toml path")
    parser.add_argument("--quantize", default=None, choices=["fp8", "int8", "int4"])
    parser.add_argument("--graphs", default="1")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=30, help="list the N kernels with the most time per step")
    parser.add_argument("--num-layers", type=int, default=None, help="keep the first N layers of the preset")
    parser.add_argument("--list-step", action="store_true", help="print the last step's kernels in launch order")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="the engine's largest batch: 1 compiles only the one-sequence step (a listing's quick form)")
    parser.add_argument("--eager-prefill", action="store_true",
                        help="skip prefill's compile (never profiled: the profile holds decode steps only)")
    parser.add_argument("--prefill", action="store_true", help="profile prefills of --prompt-len tokens instead")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no GPU kernels to count)")
    args = parser.parse_args()
    if args.prefill and args.eager_prefill:
        parser.error("--prefill profiles the compiled prefill: drop --eager-prefill")
    device = torch.device(args.device)
    hf_config = load_preset(args.preset).hf_config
    if args.num_layers is not None:
        hf_config = with_num_layers(hf_config, args.num_layers)
    model = build_random_model(hf_config, device, torch.bfloat16, quantization=args.quantize)
    config = EngineConfig.from_flat(model=args.preset, max_num_seqs=max(args.max_num_seqs, args.batch), max_num_batched_tokens=2048,
                                    max_model_len=4096, kv_cache_memory_bytes=8 << 30, compile="on",
                                    cuda_graphs=args.graphs == "1", compile_prefill=False if args.eager_prefill else None)
    engine = Engine.from_model(model, config, device)
    prompts = [list(range(1, args.prompt_len + 1))] * args.batch
    # Every stage built before the profile (the no-graph step's C++ form too), then the profiled call once: a
    # compile or a kernel's autotuning inside the profile would count its benchmark launches as the step's.
    engine.warm_up()
    # max_tokens: the prefill and the first decode step run before the profile, `steps` decode steps in it
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if args.prefill:
        prof, wall = profile_prefills(engine, args.prompt_len, args.steps, activities, device)
    else:
        prof, wall = profile_decode_steps(engine, prompts, params, activities, device)
    steps = args.steps  # decode steps or prefills in the profile
    if args.list_step:
        print_last_step(prof, steps=steps)
    per_category: dict[str, float] = defaultdict(float)
    kernels: dict[str, int] = defaultdict(int)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # kernel name -> [count, ms]
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            category = classify(event.name)
            per_category[category] += event.device_time_total / 1e3  # ms
            kernels[category] += 1
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.device_time_total / 1e3
    kernel_ms = sum(per_category.values())
    rows = {c: round(ms / steps, 3) for c, ms in sorted(per_category.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]
    top_rows = [{"kernel": name[:110], "category": classify(name), "per_step": round(n / steps, 2),
                 "us_each": round(1e3 * ms / n, 2), "ms_per_step": round(ms / steps, 4)} for name, (n, ms) in top]
    print(json.dumps({"preset": args.preset, "quantize": args.quantize, "graphs": args.graphs, "batch": args.batch,
                      "profiled": f"prefill of {args.prompt_len} tokens" if args.prefill else "decode step",
                      "top_kernels": top_rows,
                      "ms_per_step": round(1e3 * wall / steps, 3), "kernel_ms_per_step": round(kernel_ms / steps, 3),
                      "gaps_ms_per_step": round((1e3 * wall - kernel_ms) / steps, 3),
                      "kernels_per_step": round(sum(kernels.values()) / steps, 1),
                      "ms_per_step_by_category": rows,
                      "kernels_per_step_by_category": {c: round(n / steps, 1) for c, n in kernels.items()}}, indent=1))


def profile_decode_steps(engine: Engine, prompts, params: SamplingParams, activities, device: torch.device):
    """Run `prompts` to completion with only their decode steps after the first inside the profile (the prefill,
    eager or compiled, is not a decode step's) -> (the profile, its wall time in s)."""
    for prompt in prompts:
        engine.add_request(engine.make_request(prompt, replace(params)))
    engine.step()  # launches the prefill
    engine.step()  # launches the first decode step while the prefill's ids are read
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        synchronize(device)
        wall = time.perf_counter() - start
    return prof, wall


def profile_prefills(engine: Engine, prompt_len: int, num_prompts: int, activities, device: torch.device):
    """Prefill `num_prompts` prompts of `prompt_len` tokens one at a time, each to its first token, inside the
    profile; each prompt's tokens start one id later than the last's, so no cached prefix is reused -> (the
    profile, its wall time in s)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(num_prompts):
            engine.generate([list(range(2 + i, 2 + i + prompt_len))], params)
        synchronize(device)
        wall = time.perf_counter() - start
    return prof, wall


def print_last_step(prof, steps: int) -> None:
    """The device kernels of the last step, in launch order, with their device time."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time_total > 0), key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    print(f"# last step: {per_step} kernels (of {len(kernels)} in {steps} steps)")
    for event in kernels[-per_step:]:
        print(f"{event.device_time_total:8.2f} us  {classify(event.name):20s} {event.name[:150]}")


if __name__ == "__main__":
    main()
