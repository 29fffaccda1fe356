"""One bench run: copy bandwidth -> our engine at each batch size (per quantization and graph mode) -> free it
-> the transformers peer -> records."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import logging
import platform
import sys
from typing import Any

import torch
from tqdm import tqdm

from server.bench import measure, report
from server.bench.options import (
    COPY_MIB,
    DEFAULT_BATCH_SIZES,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_PROMPT_LEN,
    BenchOptions,
)
from server.bench.presets import Target, load_preset, with_num_layers
from server.config import FLAT_KEYS, EngineConfig, load_config
from server.engine import device as device_mod

log = logging.getLogger(__name__)

def cmd_bench(args: argparse.Namespace) -> int:
    from server.bench.options import options_from_args

    records = run_bench(options_from_args(args))
    print(report.table(records))
    return 0


def resolve_target(opts: BenchOptions) -> Target:
    if opts.preset is not None:
        preset = load_preset(opts.preset)
        if opts.num_layers is None:
            return Target(preset.name, preset.hf_config, None, preset.bench)
        hf_config = with_num_layers(preset.hf_config, opts.num_layers)
        return Target(f"{preset.name}[{opts.num_layers} layers]", hf_config, None, preset.bench)
    from server.engine.weights import read_config, resolve_model_path

    model_dir = resolve_model_path(opts.model)
    return Target(opts.model, read_config(model_dir), model_dir)


def run_bench(opts: BenchOptions) -> list[dict[str, Any]]:
    compile_cache = measure.compile_cache_state()  # before anything of this run is compiled
    target = resolve_target(opts)
    batch_sizes = tuple(dict.fromkeys(opts.batch_sizes or target.defaults.get("batch_sizes") or DEFAULT_BATCH_SIZES))
    prompt_len = opts.prompt_len or target.defaults.get("prompt_len", DEFAULT_PROMPT_LEN)
    decode_tokens = opts.decode_tokens or target.defaults.get("num_decode_tokens", DEFAULT_DECODE_TOKENS)
    n_short, n_long = measure.decode_lengths(decode_tokens)
    device, why = device_mod.select_device(opts.device)
    checkpoint_dtype = target.hf_config.get("torch_dtype") or target.hf_config.get("dtype")
    dtype = device_mod.select_dtype(opts.dtype, device, checkpoint_dtype)
    log.info("bench %s on %s (%s) as %s", target.name, device, why, dtype)
    vocab_size = int(target.hf_config["vocab_size"])
    prompts = {b: random_prompts(b, prompt_len, vocab_size, opts.seed + b) for b in batch_sizes}
    copy_mib = opts.copy_mib or COPY_MIB.get(device.type, 256)
    copy_gb_s = opts.copy_gb_s
    if copy_gb_s is None:
        copy_gb_s = measure.copy_bandwidth_gb_s(device, copy_mib << 20)
        release(device)  # hand the copy buffers back before the model is built
    calls_per_side = len(batch_sizes) * (1 + 3 * opts.reps)
    sides = len(opts.quantize) * len(opts.graphs) + (1 if opts.compare else 0)
    ours: dict[tuple[str, bool | None], tuple[measure.Series, Any, dict]] = {}
    with tqdm(total=calls_per_side * sides, desc="bench", unit="call", file=sys.stderr, disable=None) as progress:
        if opts.copy_gb_s is None:
            progress.write(f"device copy bandwidth: {copy_gb_s:.0f} GB/s ({copy_mib} MiB buffers)")
        for quantize in opts.quantize:
            for graphs in opts.graphs:
                ours[quantize, graphs] = measure_ours(opts, quantize, graphs, target, device, dtype, prompts,
                                                      (n_short, n_long), progress)
                release(device)
        peer = None
        if opts.compare:
            is_moe = next(iter(ours.values()))[1].num_experts > 0
            from server.bench.peer import peer_series  # transformers' side: imported when compared

            peer = peer_series(opts, target, device, dtype, prompts, (n_short, n_long), is_moe, progress)
        release(device)
    common = {
        "preset": target.name, "model_type": target.hf_config["model_type"], "device": device.type,
        "gpu_name": device_name(device), "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": prompt_len, "num_decode_tokens": decode_tokens, "n_short": n_short, "n_long": n_long,
        "copy_gb_s": copy_gb_s, "torch_version": torch.__version__, "engine_options": dict(opts.engine_options),
        "transformers_version": _transformers_version(opts), "reps": opts.reps, "seed": opts.seed,
        "compile_cache": compile_cache,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    peer_weights = None
    if peer is not None:  # transformers reads the unquantized weights, whichever of ours it is compared with
        from server.bench.random_model import empty_model

        peer_weights = measure.weight_bytes(empty_model(target.hf_config, "meta", dtype))
    records = [
        build_record({**common, "quantize": quantize, **info}, b, series, peer, weights, peer_weights, copy_gb_s)
        for (quantize, _), (series, weights, info) in ours.items() for b in batch_sizes
    ]
    if opts.json_path:
        report.append_json_lines(opts.json_path, records)
    return records


def build_record(common: dict, batch_size: int, ours: measure.Series, peer: measure.Series | None, weights, peer_weights,
                 copy_gb_s: float) -> dict:
    record = {**common, "batch_size": batch_size, **report.roofline_fields(batch_size, weights, copy_gb_s)}
    record.update(report.speed_fields(ours.rates[batch_size], weights, copy_gb_s))
    kernels = ours.kernels.get(batch_size)
    record["kernels_per_step"] = kernels.num_kernels if kernels else None
    record["kernel_ms_per_step"] = kernels.kernel_ms if kernels else None
    rates = ours.rates[batch_size]  # start-up as a server pays it: build, then the first call's compile and capture
    record["startup_s"] = {"build": common["build_s"], "first_call": rates.t_first, "compile": rates.warmup_s,
                           "compile_cache": common["compile_cache"]}
    record["sample_token_ids"] = ours.tokens[batch_size]
    if peer is not None and batch_size in peer.rates:
        record.update(report.speed_fields(peer.rates[batch_size], peer_weights, copy_gb_s, prefix="peer_"))
        record["speedup_vs_peer"] = record["decode_tok_s"] / record["peer_decode_tok_s"]
        record["peer_sample_token_ids"] = peer.tokens[batch_size]
        record["peer_tokens_match_prefix"] = _common_prefix(ours.tokens[batch_size], peer.tokens[batch_size])
        record["peer_mode"] = peer.modes[batch_size]
        record["peer_note"] = "; ".join(peer.notes) or None
    elif peer is not None:
        record["peer_decode_tok_s"] = record["speedup_vs_peer"] = None
        record["peer_note"] = "; ".join(peer.notes) or "the peer was not measured"
    bad = report.check_finite(record)
    if bad:
        log.warning("batch %d: non-positive or non-finite measurements %s", batch_size, bad)
    return record


def measure_ours(opts, quantize: str, graphs: bool | None, target: Target, device, dtype, prompts, lengths,
                 progress) -> tuple[measure.Series, Any, dict]:
    from server.engine.types import SamplingParams

    side = " ".join(["ours", *([quantize] if quantize != "none" else []), *(["no graphs"] if graphs is False else [])])
    progress.set_description(f"{side}: building {target.name}")
    max_len = max(len(p[0]) for p in prompts.values()) + lengths[1] + 1
    config = engine_config(opts, quantize, graphs, target, device, dtype, max(prompts), max_len)
    build_s, engine = measure.timed(lambda: _build_engine(opts, target, config, device, dtype, max_len), device)
    weights = measure.weight_bytes(engine.model)
    info = {
        "build_s": build_s, "weight_bytes_total": measure.total_weight_bytes(engine.model),
        "bits_per_weight": engine.bits_per_weight,
        "engine_config": {k: v for k, v in engine.config.flat().items() if k != "model"},
        "compile_prefill": engine.steps.compile_prefill,  # the config's None resolved for this device and model
        "decode_attention": _decode_attention(engine),  # which attention each decode graph runs
        "cuda_graphs": engine.runner.decode_graphs is not None and engine.runner.decode_graphs.use_graphs,
        "kernels_counted_by": measure.kernels_counted_by(device),
    }
    total = report.gigabytes(info["weight_bytes_total"])
    progress.write(f"built {target.name} in {build_s:.1f} s: {total} of weights, "
                   f"{report.gigabytes(weights.per_token)} read per token at batch 1")

    def generate(batch: list[list[int]], num_new: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        return [out.token_ids for out in engine.generate(batch, params)]

    series = measure.Series()
    for batch in prompts.values():
        measure.measure_series(series, side, generate, device, batch, lengths, opts.reps, progress)
    for batch in prompts.values():  # after all of this engine's timed calls: no profiler runs before one
        series.kernels[len(batch)] = _try_profile_kernels(engine, batch, device, side, progress)
    info["kernel_launch"] = engine.runner.kernel_launch  # after the calls: a failed C++ build has fallen back by now
    return series, weights, info


def _try_profile_kernels(engine, batch: list[list[int]], device, side: str,
                       progress) -> measure.KernelProfile | None:
    """None, with a warning, where profiling fails: the measured speeds are kept."""
    try:
        profile = decode_step_kernels(engine, batch, device)
    except Exception as exc:
        progress.write(f"{side} B={len(batch)}: kernels per step not counted: {type(exc).__name__}: {measure.first_line(exc)}")
        return None
    method = measure.kernels_counted_by(device)
    took = "" if profile.kernel_ms is None else f", {profile.kernel_ms:.3f} ms of kernel time"
    progress.write(f"{side} B={len(batch)}: {profile.num_kernels} kernels per decode step ({method}){took}")
    return profile


def decode_step_kernels(engine, batch: list[list[int]], device) -> measure.KernelProfile:
    """Kernels of one steady decode step (measure.profile_kernels), counted after the timed calls so that the
    profiler does not touch their times. The batch runs until every sequence has two tokens launched past its
    prompt: the profiled step then launches a plain decode step (a shape the timed calls compiled and captured)
    while it finishes the one before, as every step of a steady decode does."""
    from server.engine.types import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [engine.inputs.make_request(prompt, dataclasses.replace(params)) for prompt in batch]
    for request in requests:
        engine.add_request(request)
    try:
        while any(r.num_output_tokens < 2 for r in requests):
            engine.step()
        return measure.profile_kernels(engine.step, device)
    finally:
        while engine.has_unfinished:  # leave the engine idle for the next generate()
            engine.step()


def _decode_attention(engine) -> dict[str, str] | None:
    graphs = engine.runner.decode_graphs
    return None if graphs is None else {"batch_1": "flex" if graphs.step.flex_at_batch_1 else "sdpa", "batch_2_up": "sdpa"}


def _build_engine(opts, target: Target, config: EngineConfig, device, dtype, max_len: int):
    from server.engine.engine import Engine

    if target.model_dir is not None:
        return Engine.from_config(config)
    from server.bench.random_model import build_random_model, load_random

    if config.parallel.tensor_parallel > 1 or config.parallel.pipeline_parallel > 1:
        from server.engine.distributed import start_engine

        return Engine(*start_engine(config, functools.partial(load_random, target.hf_config, opts.seed, max_len)))
    model = build_random_model(target.hf_config, device, dtype, opts.seed, config.load.quantization)
    return Engine.from_model(model, config, device, max_model_len=max_len)


def engine_config(opts, quantize: str, graphs: bool | None, target: Target, device, dtype, max_batch: int,
                  max_len: int) -> EngineConfig:
    from server.bench.random_model import empty_model
    from server.engine.model_runner import KVCache

    base = load_config(opts.config_file).engine
    names = set(FLAT_KEYS)
    unknown = sorted(set(opts.engine_options) - names)
    if unknown:
        raise ValueError(f"--engine-option: unknown EngineConfig fields {unknown}; valid: {sorted(names)}")
    block_size = opts.engine_options.get("block_size", base.cache.block_size)
    max_len = -(-max_len // block_size) * block_size
    shapes = empty_model(target.hf_config, "meta", dtype).kv_cache_shapes()
    num_blocks = max_batch * (max_len // block_size) + 2
    dtype_name = str(dtype).removeprefix("torch.")
    settings = dict(
        model=target.name, device=device.type, dtype=dtype_name, quantization=None if quantize == "none" else quantize,
        max_num_seqs=max_batch, max_model_len=max_len, enable_prefix_caching=False,
        kv_cache_memory_bytes=KVCache.bytes_per_block(shapes, block_size, dtype) * num_blocks,
    )
    for field_name in ("tensor_parallel", "pipeline_parallel"):
        if getattr(opts, field_name):
            settings[field_name] = getattr(opts, field_name)
    settings.update(opts.engine_options)  # the user's --engine-option wins over the bench's own sizing
    if graphs is not None:
        settings["cuda_graphs"] = graphs
    return base.replace_flat(**settings)


def random_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, prompt_len), generator=generator).tolist()


def release(device: torch.device) -> None:
    """Drop compiled graphs (they hold the model) and cached blocks, so the next model fits."""
    gc.collect()
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        log.info("after release: %.2f GB still allocated on %s", torch.cuda.memory_allocated(device) / 1e9, device)
    elif device.type == "mps":
        torch.mps.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} (MPS)"
    return platform.processor() or platform.machine()


def _transformers_version(opts: BenchOptions) -> str | None:
    if not opts.compare:
        return None
    from server.bench.peer import transformers_version

    return transformers_version()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
