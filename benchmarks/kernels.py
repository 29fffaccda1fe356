"""Kernel benchmarks for server/kernels on a CUDA GPU (imports only torch and server.kernels).

    PYTHONPATH=. python3 benchmarks/kernels.py [--json results.json] [--skip gemv,moe,sampling] [--tokens 1,4,64] \
        [--no-compile]

Prints: the capability table; copy bandwidth (the roofline, measured in the same run); bf16 GEMV and FP8 linear
GB/s at LLM shapes; one Qwen3-30B-A3B MoE layer at 1, 4 and 64 tokens (--tokens), stage by stage in bf16 and FP8
(and the grouped GEMMs compiled under max-autotune, where inductor's Triton template competes), against a Python
loop over experts with host syncs; softmax + sampling over one [1, 128256] row; a sync check under
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

from server.kernels import compat, moe, moe_fp8, sampling
from server.kernels.capabilities import capabilities
from server.kernels.fp8 import fp8_linear, quantize_activation, quantize_fp8_rowwise
from server.kernels.plan import StepPlan
from server.kernels.plan import step_plan as _step_plan

ROTATE_BYTES = 256 * 2**20  # several times a GPU's L2: every call reads its weights from memory
GEMV_SHAPES = [(2048, 2048), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
DEVICE = torch.device("cuda")


def step_plan(traced: bool = False) -> StepPlan:
    """The forms an eager (or compiled) step runs on DEVICE: compiled variants get the compiled plan, as the
    engine's compiled steps do."""
    return _step_plan(DEVICE, torch.bfloat16, traced)


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
        compat.synchronize(DEVICE)
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
    return 2 * 2**31 / (micros * 1e-6) / 1e9


def bench_gemv(copy_gbps: float, rows: list[dict]) -> None:
    print("\n## GEMV, one token: y = x W^T (weight GB/s = stored weight bytes / time)")
    print("| W (N x K) | variant | graph us | eager us | weight GB/s | % of copy | x vs bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for num_out, num_in in GEMV_SHAPES:
        bench_gemv_shape(num_out, num_in, copy_gbps, rows)
        torch.cuda.empty_cache()


def bench_gemv_shape(num_out: int, num_in: int, copy_gbps: float, rows: list[dict]) -> None:
    bf16_bytes, fp8_bytes = num_out * num_in * 2, num_out * num_in + num_out * 4
    copies = max(2, math.ceil(ROTATE_BYTES / bf16_bytes))
    weights = [torch.randn(num_out, num_in, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies)]
    quant = [quantize_fp8_rowwise(w) for w in weights]
    x = torch.randn(1, 1, num_in, device=DEVICE, dtype=torch.bfloat16)
    x_fp8, x_scale = quantize_activation(x)
    ref = x.float().view(1, -1) @ weights[0].float().t()
    plan = step_plan()
    variants = {
        "bf16 F.linear": (lambda i: F.linear(x, weights[i % copies]), bf16_bytes),
        "fp8 fp8_linear (x quantized once, outside)": (
            lambda i: fp8_linear(x_fp8, x_scale, *quant[i % copies], None, torch.bfloat16, plan),
            fp8_bytes,
        ),
        "fp8 quantize_activation + fp8_linear": (
            lambda i: fp8_linear(*quantize_activation(x), *quant[i % copies], None, torch.bfloat16, plan),
            fp8_bytes,
        ),
    }
    bf16_graph = None
    for name, (fn, nbytes) in variants.items():
        err = rel_err(fn(0).view(1, -1), ref)
        graph_us, eager_us = time_graph(fn, calls=40), time_eager(fn, calls=40)
        fastest = best(graph_us, eager_us)
        bf16_graph = bf16_graph or graph_us
        gbps = nbytes / (fastest * 1e-6) / 1e9
        ratio = bf16_graph / graph_us if isinstance(graph_us, float) else float("nan")
        print(
            f"| {num_out}x{num_in} | {name} | {fmt(graph_us)} | {fmt(eager_us)} | {gbps:.0f} | "
            f"{100 * gbps / copy_gbps:.0f}% | {ratio:.2f} | {err:.1e} |"
        )
        rows.append(
            dict(
                section="gemv",
                shape=[num_out, num_in],
                variant=name,
                graph_us=graph_us,
                eager_us=eager_us,
                gbps=gbps,
                pct_copy=100 * gbps / copy_gbps,
                rel_err=err,
            )
        )


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


HIDDEN, NUM_EXPERTS, TOP_K, INTER = 2048, 128, 8, 768  # Qwen3-30B-A3B
NUM_LAYERS, NUM_INPUTS = 4, 8  # 4 layers x 1.2 GB rotate far past the L2


def make_moe_layers() -> tuple[list[dict], list[dict]]:
    layers, layers_fp8 = [], []
    for _ in range(NUM_LAYERS):
        layer = dict(
            router=torch.randn(NUM_EXPERTS, HIDDEN, device=DEVICE, dtype=torch.bfloat16) / HIDDEN**0.5,
            gate_up=torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, dtype=torch.bfloat16) / HIDDEN**0.5,
            down=torch.randn(NUM_EXPERTS, HIDDEN, INTER, device=DEVICE, dtype=torch.bfloat16) / INTER**0.5,
        )
        layers.append(layer)
        gate_up_q, gate_up_scale = moe_fp8.quantize_experts(layer["gate_up"])
        down_q, down_scale = moe_fp8.quantize_experts(layer["down"])
        layers_fp8.append(dict(router=layer["router"], args=(gate_up_q, gate_up_scale, down_q, down_scale)))
    return layers, layers_fp8


def moe_layer(x, layer, plan: StepPlan | None = None):
    plan = plan or step_plan()
    weights, expert_ids = moe.route_softmax(F.linear(x, layer["router"]), TOP_K, True, plan)
    return moe.moe_experts(x, weights, expert_ids, layer["gate_up"], layer["down"], plan)


def moe_layer_fp8(x, layer, plan: StepPlan | None = None):
    plan = plan or step_plan()
    weights, expert_ids = moe.route_softmax(F.linear(x, layer["router"]), TOP_K, True, plan)
    return moe_fp8.moe_experts_fp8(x, weights, expert_ids, *layer["args"], plan)


def moe_layer_loop(x, layer):
    weights, expert_ids = moe.route_softmax(F.linear(x, layer["router"]), TOP_K, True, step_plan())
    return loop_experts(x, weights, expert_ids, layer["gate_up"], layer["down"])


def moe_layer_grouped(x, layer, plan: StepPlan | None = None):
    """Route + the grouped_mm path even where moe_experts would pick another (to compare under compile)."""
    plan = plan or step_plan()
    weights, expert_ids = moe.route_softmax(F.linear(x, layer["router"]), TOP_K, True, plan)
    return moe._experts_grouped(x, weights, expert_ids, layer["gate_up"], layer["down"], plan.private_ops)


def moe_stage_inputs(layers, layers_fp8, xs) -> list[dict]:
    """Every intermediate of the fast paths (bf16, and FP8 under "fp8") per rotation slot, so each stage can be
    timed alone."""
    stages = []
    for j, x in enumerate(xs):
        layer = layers[j % NUM_LAYERS]
        weights, expert_ids = moe.route_softmax(F.linear(x, layer["router"]), TOP_K, True, step_plan())
        order, offs = moe.sort_by_expert(expert_ids, NUM_EXPERTS)
        x_sorted = x.index_select(0, order // TOP_K)
        hidden = compat.grouped_mm(x_sorted, layer["gate_up"].transpose(-2, -1), offs)
        act = moe.swiglu(hidden)
        y_sorted = compat.grouped_mm(act, layer["down"].transpose(-2, -1), offs)
        gate_up_q, gate_up_scale, down_q, down_scale = layers_fp8[j % NUM_LAYERS]["args"]
        x_fp8, x_scale = quantize_activation(x)  # [T, H], [T, 1]
        x_fp8_sorted = moe_fp8._gather_fp8(x_fp8, order // TOP_K)
        x_scale_sorted = x_scale.view(-1).index_select(0, order // TOP_K)
        act_fp8, act_scale = quantize_activation(act)
        stages.append(
            dict(
                fp8=dict(x_sorted=x_fp8_sorted, x_sorted_scale=x_scale_sorted, act=act_fp8, act_scale=act_scale.view(-1),
                         gate_up=gate_up_q.transpose(-2, -1), gate_up_scale=gate_up_scale,
                         down=down_q.transpose(-2, -1), down_scale=down_scale, offs=offs),
                layer=layer,
                x=x,
                weights=weights,
                expert_ids=expert_ids,
                order=order,
                offs=offs,
                x_sorted=x_sorted,
                hidden=hidden,
                act=act,
                y_sorted=y_sorted,
            )
        )
    return stages


def moe_variants(layers, layers_fp8, xs, stages, num_tokens, use_compile):
    def at(fn):
        return lambda i: fn(stages[i % NUM_INPUTS])

    variants = {
        "stage: routing (router F.linear + softmax + top-k)": at(
            lambda s: moe.route_softmax(F.linear(s["x"], s["layer"]["router"]), TOP_K, True, step_plan())
        ),
        "stage: sort + searchsorted int32 offsets": at(lambda s: moe.sort_by_expert(s["expert_ids"], NUM_EXPERTS)),
        "stage: sort + searchsorted, int16 keys": at(lambda s: sort_by_expert_int16(s["expert_ids"], NUM_EXPERTS)),
        "stage: gather tokens (index_select)": at(lambda s: s["x"].index_select(0, s["order"] // TOP_K)),
        "stage: grouped_mm gate_up": at(
            lambda s: compat.grouped_mm(s["x_sorted"], s["layer"]["gate_up"].transpose(-2, -1), s["offs"])
        ),
        "stage: silu(gate) * up": at(lambda s: moe.swiglu(s["hidden"])),
        "stage: grouped_mm down": at(
            lambda s: compat.grouped_mm(s["act"], s["layer"]["down"].transpose(-2, -1), s["offs"])
        ),
        "stage: fp8 quantize tokens (rowwise)": at(lambda s: quantize_activation(s["x"])),
        "stage: fp8 scaled_grouped_mm gate_up": at(lambda s: scaled_grouped(s["fp8"], "x_sorted", "gate_up")),
        "stage: fp8 swiglu + quantize": at(lambda s: quantize_activation(moe.swiglu(s["hidden"]))),
        "stage: fp8 scaled_grouped_mm down": at(lambda s: scaled_grouped(s["fp8"], "act", "down")),
        "stage: weighted unpermute (index_copy + bmm)": at(
            lambda s: moe.combine_slots(s["y_sorted"], s["order"], s["weights"])
        ),
        "layer: route + moe_experts (grouped_mm)": lambda i: moe_layer(xs[i % NUM_INPUTS], layers[i % NUM_LAYERS]),
        "layer: route + moe_experts_fp8 (scaled_grouped_mm)": lambda i: moe_layer_fp8(
            xs[i % NUM_INPUTS], layers_fp8[i % NUM_LAYERS]
        ),
    }
    fallback = moe._experts_gather_bmm if num_tokens * TOP_K <= NUM_EXPERTS else moe._experts_dense
    variants[f"layer: fallback {fallback.__name__} (no grouped_mm)"] = at(
        lambda s: fallback(s["x"], s["weights"], s["expert_ids"], s["layer"]["gate_up"], s["layer"]["down"])
    )
    if use_compile:
        path = "gather-reduce" if moe.few_slots(num_tokens * TOP_K, NUM_EXPERTS) else "grouped_mm"
        for label, fn, weights in (
            (f"route + moe_experts ({path})", moe_layer, layers),
            (
                f"route + moe_experts_fp8 ({path if path == 'gather-reduce' else 'scaled_grouped_mm'})",
                moe_layer_fp8,
                layers_fp8,
            ),
            ("route + grouped_mm path forced", moe_layer_grouped, layers),
        ):
            variants[f"layer: torch.compile({label})"] = compiled_layer(fn, xs, weights)
        # Inductor's Triton grouped-GEMM template competes with the library kernel only under max-autotune.
        autotuned = {"bf16 grouped_mm": torch.compile(compat.grouped_mm, mode="max-autotune-no-cudagraphs"),
                     "fp8 scaled_grouped_mm": torch.compile(scaled_grouped, mode="max-autotune-no-cudagraphs")}
        variants["stage: bf16 grouped_mm gate_up, max-autotune"] = at(
            lambda s: autotuned["bf16 grouped_mm"](s["x_sorted"], s["layer"]["gate_up"].transpose(-2, -1), s["offs"]))
        variants["stage: fp8 scaled_grouped_mm gate_up, max-autotune"] = at(
            lambda s: autotuned["fp8 scaled_grouped_mm"](s["fp8"], "x_sorted", "gate_up"))
    return variants


def sort_by_expert_int16(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.sort_by_expert on 16-bit keys: a radix sort's passes grow with the key's width (int64: 64 bits)."""
    sorted_ids, order = torch.sort(expert_ids.reshape(-1).to(torch.int16))
    experts = torch.arange(num_experts, device=expert_ids.device, dtype=torch.int16)
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def scaled_grouped(fp8: dict, rows: str, weight: str) -> torch.Tensor:
    """One FP8 expert projection of the sorted slots, row-wise scaled, as moe_fp8 runs it -> [T*k, N] bf16."""
    return compat.scaled_grouped_mm_rowwise(fp8[rows], fp8[weight], fp8[f"{rows}_scale"], fp8[f"{weight}_scale"],
                                            fp8["offs"], torch.bfloat16)


def compiled_layer(fn, xs, layers) -> Callable[[int], object]:
    compiled, plan = torch.compile(fn, fullgraph=True, dynamic=False), step_plan(traced=True)
    return lambda i: compiled(xs[i % NUM_INPUTS], layers[i % NUM_LAYERS], plan)


def bench_moe(num_tokens: int, layers, layers_fp8, copy_gbps: float, use_compile: bool, rows: list[dict]) -> None:
    xs = [torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16) for _ in range(NUM_INPUTS)]
    stages = moe_stage_inputs(layers, layers_fp8, xs)
    distinct = sum(torch.unique(s["expert_ids"]).numel() for s in stages) / NUM_INPUTS
    expert_bytes = 3 * INTER * HIDDEN * 2
    ref = moe.moe_experts_reference(
        xs[0].double(),
        stages[0]["weights"].double(),
        stages[0]["expert_ids"],
        layers[0]["gate_up"].double(),
        layers[0]["down"].double(),
    )
    print(
        f"\n## MoE layer, Qwen3-30B-A3B shape, tokens = {num_tokens}: {distinct:.1f} distinct experts, "
        f"{distinct * expert_bytes / 1e6:.0f} MB of bf16 expert weights per call"
    )
    print("| variant | graph us | eager us | expert GB/s | % of copy | x vs loop | rel err vs fp64 loop |")
    print("|---|---|---|---|---|---|---|")
    loop_us = time_eager(lambda i: moe_layer_loop(xs[i % NUM_INPUTS], layers[i % NUM_LAYERS]), calls=5, reps=3)
    outputs = {"loop over experts (.tolist() host sync)": moe_layer_loop(xs[0], layers[0])}
    _print_moe_row(
        "loop over experts (.tolist() host sync)",
        "not capturable",
        loop_us,
        distinct * expert_bytes,
        loop_us,
        outputs,
        ref,
        num_tokens,
        rows,
        copy_gbps,
    )
    for name, fn in moe_variants(layers, layers_fp8, xs, stages, num_tokens, use_compile).items():
        start = time.monotonic()
        try:
            out = fn(0)
        except Exception as exc:  # report a failing variant and go on with the others
            print(f"| {name} | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]} | | | | | |")
            continue
        compile_note = f" (first call {time.monotonic() - start:.0f} s)" if "compile" in name else ""
        graph_us, eager_us = time_graph(fn, calls=20), time_eager(fn, calls=20)
        nbytes = distinct * expert_bytes * (0.5 if "fp8" in name else 1.0) if name.startswith("layer") else None
        outputs[name] = out if name.startswith("layer") else None
        _print_moe_row(
            name + compile_note,
            graph_us,
            eager_us,
            nbytes,
            loop_us,
            outputs,
            ref,
            num_tokens,
            rows,
            copy_gbps,
            key=name,
        )


def _print_moe_row(name, graph_us, eager_us, nbytes, loop_us, outputs, ref, num_tokens, rows, copy_gbps, key=None):
    fastest = best(graph_us, eager_us)
    gbps = nbytes / (fastest * 1e-6) / 1e9 if nbytes else None
    out = outputs.get(key or name)
    err = f"{rel_err(out, ref):.1e}" if isinstance(out, torch.Tensor) else ""
    gb_text = f"{gbps:.0f} | {100 * gbps / copy_gbps:.0f}%" if gbps else " | "
    speedup = f"{loop_us / fastest:.1f}" if (key or name).startswith("layer") else ""
    print(f"| {name} | {fmt(graph_us)} | {fmt(eager_us)} | {gb_text} | {speedup} | {err} |")
    rows.append(
        dict(
            section="moe",
            num_tokens=num_tokens,
            variant=name,
            graph_us=graph_us,
            eager_us=eager_us,
            gbps=gbps,
            rel_err=err,
        )
    )


VOCAB = 128256


def sampling_variants(num_rows: int) -> dict[str, Callable[[int], object]]:
    logits = [torch.randn(num_rows, VOCAB, device=DEVICE) * 3 for _ in range(4)]

    def batch_of(**settings):
        rows = [sampling.SamplingRow(seed=1000 + b, step=7, **settings) for b in range(num_rows)]
        return sampling.build_sampling_batch(rows, VOCAB, DEVICE)

    greedy, plain = batch_of(temperature=0.0), batch_of(temperature=0.8)
    top_k, top_p = batch_of(temperature=0.8, top_k=50), batch_of(temperature=0.8, top_k=50, top_p=0.9)
    min_p = batch_of(temperature=0.8, min_p=0.05)
    penalties = batch_of(
        temperature=0.8,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={13: 2.0},
        prompt_token_ids=list(range(0, 4000, 3)),
        output_token_ids=list(range(50, 300)),
        num_logprobs=5,
    )
    return {
        "softmax": lambda i: torch.softmax(logits[i % 4], dim=-1),
        "baseline: softmax(l/T) + torch.multinomial": lambda i: torch.multinomial(
            torch.softmax(logits[i % 4] / 0.8, dim=-1), 1
        ),
        "baseline: softmax(l/T) / exponential_() race": lambda i: torch.argmax(
            torch.softmax(logits[i % 4] / 0.8, dim=-1) / torch.empty_like(logits[i % 4]).exponential_(), dim=-1
        ),
        "sample: greedy (all rows)": lambda i: sampling.sample(logits[i % 4], greedy),
        "sample: temperature (hash noise + race)": lambda i: sampling.sample(logits[i % 4], plain),
        "sample: temperature + top-k 50": lambda i: sampling.sample(logits[i % 4], top_k),
        "sample: temperature + top-k 50 + top-p 0.9 (full sort)": lambda i: sampling.sample(logits[i % 4], top_p),
        "sample: temperature + min-p 0.05": lambda i: sampling.sample(logits[i % 4], min_p),
        "sample: penalties + bias + top-5 logprobs": lambda i: sampling.sample(logits[i % 4], penalties),
    }


def bench_sampling(rows: list[dict], use_compile: bool) -> None:
    for num_rows in (1, 64):
        print(f"\n## Softmax and sampling over [{num_rows}, {VOCAB}] fp32")
        print("| op | graph us | eager us |")
        print("|---|---|---|")
        variants = sampling_variants(num_rows)
        if use_compile:
            variants["torch.compile(sample): temperature"] = compiled_sample(num_rows)
        for name, fn in variants.items():
            try:
                fn(0)
            except Exception as exc:  # report a failing variant and go on with the others
                print(f"| {name} | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]} | |")
                continue
            graph_us, eager_us = time_graph(fn, calls=50), time_eager(fn, calls=50)
            print(f"| {name} | {fmt(graph_us)} | {fmt(eager_us)} |")
            rows.append(dict(section="sampling", num_rows=num_rows, variant=name, graph_us=graph_us, eager_us=eager_us))


def compiled_sample(num_rows: int) -> Callable[[int], object]:
    rows = [sampling.SamplingRow(0.8, seed=3 + b) for b in range(num_rows)]
    batch = sampling.build_sampling_batch(rows, VOCAB, DEVICE)
    compiled = torch.compile(sampling.sample, fullgraph=True, dynamic=False)
    logits = torch.randn(num_rows, VOCAB, device=DEVICE)
    return lambda i: compiled(logits, batch)


def sync_check(layers, layers_fp8) -> list[str]:
    """Run the decode-step kernels under set_sync_debug_mode('error'): any host sync raises."""
    x = torch.randn(4, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(4, VOCAB, device=DEVICE)
    rows = [
        sampling.SamplingRow(
            t,
            top_k=40,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.1,
            seed=s,
            output_token_ids=[1, 2, 3],
            logit_bias={5: 1.0},
            num_logprobs=2,
        )
        for s, t in enumerate((0.0, 0.7, 1.0, 1.3))
    ]
    batch = sampling.build_sampling_batch(rows, VOCAB, DEVICE)
    greedy = sampling.build_sampling_batch([sampling.SamplingRow(0.0)] * 4, VOCAB, DEVICE)
    checks = {
        "route_softmax + moe_experts": lambda: moe_layer(x, layers[0]),
        "route_softmax + moe_experts_fp8": lambda: moe_layer_fp8(x, layers_fp8[0]),
        "route_sigmoid_bias": lambda: moe.route_sigmoid_bias(
            F.linear(x, layers[0]["router"]), torch.zeros(NUM_EXPERTS, device=DEVICE), TOP_K, True, 2.5, step_plan()
        ),
        "sample (all filters, penalties, bias, logprobs)": lambda: sampling.sample(logits, batch),
        "sample (greedy)": lambda: sampling.sample(logits, greedy),
        "fp8 quantize_activation + fp8_linear": lambda: fp8_linear(
            *quantize_activation(x), *quantize_fp8_rowwise(layers[0]["router"]), None, torch.bfloat16, step_plan()
        ),
        "build_sampling_batch (host->device, pinned)": lambda: sampling.build_sampling_batch(rows, VOCAB, DEVICE),
    }
    results = []
    compat.synchronize(DEVICE)
    for name, fn in checks.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            results.append(f"{name}: no host sync")
        except RuntimeError as exc:
            results.append(f"{name}: SYNC ({str(exc).splitlines()[0][:120]})")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        compat.synchronize(DEVICE)
    return results


def parity_check() -> list[str]:
    """The sampler on the GPU against its per-row twin, and the noise against the CPU's, bit for bit."""
    vocab = 32000
    rows = [
        sampling.SamplingRow(
            t,
            top_k=k,
            top_p=p,
            min_p=m,
            seed=11 * b,
            step=b,
            repetition_penalty=1.2,
            output_token_ids=[5, 6, 6],
            prompt_token_ids=[1, 2],
            num_logprobs=3,
        )
        for b, (t, k, p, m) in enumerate(
            [
                (0.0, 0, 1.0, 0.0),
                (0.7, 40, 1.0, 0.0),
                (1.0, 0, 0.9, 0.0),
                (1.3, 0, 1.0, 0.1),
                (0.9, 100, 0.8, 0.05),
                (1.0, 0, 1.0, 0.0),
            ]
        )
    ]
    mismatches, total = 0, 0
    for trial in range(20):
        for row in rows:
            row.step = trial
        batch = sampling.build_sampling_batch(rows, vocab, DEVICE)
        logits = torch.randn(len(rows), vocab, device=DEVICE) * 2
        fast, ref = sampling.sample(logits, batch), sampling.sample_reference(logits, batch)
        mismatches += int((fast.token_ids != ref.token_ids).sum())
        total += len(rows)
    lo = torch.arange(8)
    cpu = sampling.exponential_noise(lo, lo * 3, lo + 5, 4096)
    gpu = sampling.exponential_noise(lo.to(DEVICE), (lo * 3).to(DEVICE), (lo + 5).to(DEVICE), 4096).cpu()
    return [
        f"sample vs sample_reference on cuda: {total - mismatches}/{total} tokens equal",
        f"exponential_noise cuda == cpu bit for bit: {torch.equal(cpu, gpu)}",
    ]


def streams_check() -> str:
    from server.kernels.streams import DeviceStreams

    streams = DeviceStreams(DEVICE)
    big = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.arange(64, device=DEVICE)
    for _ in range(4):
        big = big @ big / 90.0  # keeps the main stream busy while the copy is in flight
    pending = streams.copy_to_host(ids * 2)
    ready_early = pending.ready()
    host = pending.wait()
    ok = host.tolist() == list(range(0, 128, 2)) and not host.is_cuda
    return f"DeviceStreams.copy_to_host: values {'ok' if ok else 'WRONG'}, ready before wait: {ready_early}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: gemv,moe,sampling")
    parser.add_argument("--tokens", default="1,4,64", help="MoE token counts")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("\n## capabilities()\n```\n" + "\n".join(capabilities(DEVICE).describe()) + "\n```")
    rows: list[dict] = []
    copy_gbps = copy_bandwidth()
    print(f"\ncopy bandwidth (2 GiB -> 2 GiB, read + write): {copy_gbps:.0f} GB/s")
    rows.append(dict(section="copy", gbps=copy_gbps))
    skip = set(args.skip.split(","))
    if "gemv" not in skip:
        bench_gemv(copy_gbps, rows)
    layers, layers_fp8 = make_moe_layers()
    if "moe" not in skip:
        for num_tokens in [int(t) for t in args.tokens.split(",")]:
            bench_moe(num_tokens, layers, layers_fp8, copy_gbps, not args.no_compile, rows)
    if "sampling" not in skip:
        bench_sampling(rows, not args.no_compile)
    print("\n## Sync check (torch.cuda.set_sync_debug_mode('error'))")
    for line in sync_check(layers, layers_fp8) + parity_check() + [streams_check()]:
        print(f"- {line}")
        rows.append(dict(section="check", result=line))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
