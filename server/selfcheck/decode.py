"""The decode step end to end: compiled against eager with the same tokens, then short decodes through the bench
(tok/s, kernels per step, roofline fraction) on a tiny random model (compiled) and on the smallest preset whose
weights fit this device's memory with room for the KV cache (eager: its cold compile alone would take minutes)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from server.bench import measure
from server.bench.options import BenchOptions
from server.bench.presets import available_presets, load_preset
from server.compile.background import describe_failure
from server.config import EngineConfig
from server.engine.weights import empty_model
from server.kernels.flex_probe import probe_compiled
from server.selfcheck.results import FAIL, PASS, SKIP, Check, attempt

SECTION = "decode"
TINY_PRESET = "tiny-moe"
KV_ALLOWANCE = 0.25  # share of the device's memory left for the KV cache, activations and the compiled graphs
COMPILE_CHECK_TOKENS = 16


@dataclass(frozen=True)
class DecodeSizes:
    prompt_len: int
    decode_tokens: int
    reps: int
    compile: bool  # compile the decode step here (minutes on a small CPU)
    preset: bool  # run a real-size preset where one fits


@dataclass(frozen=True)
class Copy:
    """The copy bandwidth the speed checks measured (gb_s None where that failed: the bench measures it, in `mib`
    MiB buffers): every roofline of the report is a fraction of one figure."""

    mib: int
    gb_s: float | None


FULL = DecodeSizes(32, 32, 2, compile=True, preset=True)
QUICK = DecodeSizes(16, 32, 2, compile=False, preset=False)


def decode_checks(device: torch.device, dtype: torch.dtype, sizes: DecodeSizes, copy: Copy) -> list[Check]:
    checks = [
        attempt(SECTION, "compiled_vs_eager", lambda: check_compiled_vs_eager(device, sizes)),
        attempt(SECTION, "flex_decode_compiled", lambda: check_flex_compiled(device, dtype, sizes)),
        attempt(SECTION, f"decode_{TINY_PRESET}", lambda: check_bench_decode(device, TINY_PRESET, "none", sizes,
                                                                             copy)),
    ]
    preset, quantize, why = fitting_preset(device, dtype)
    if preset is not None and not sizes.preset:
        preset, why = None, f"skipped with --quick ({why} would fit)"
    if preset is None:
        checks.append(Check(SECTION, "decode_preset", SKIP, why))
    else:
        checks.append(attempt(SECTION, f"decode_{preset}", lambda: check_bench_decode(
            device, preset, quantize, sizes, copy, why, compiled=False)))
    return checks


def check_compiled_vs_eager(device: torch.device, sizes: DecodeSizes) -> Check:
    """Greedy tokens of the tiny random model through the compiled decode step and through eager, in float32
    (where both must pick the same argmax). A compile that fails is this check's FAIL, with the root cause."""
    if not sizes.compile:
        return Check(SECTION, "compiled_vs_eager", SKIP, "skipped with --quick (compiling takes minutes on a small CPU)")
    from server.bench.random_model import build_random_model
    from server.engine.engine import Engine
    from server.engine.types import SamplingParams

    hf_config = load_preset(TINY_PRESET).hf_config
    model = build_random_model(hf_config, device, torch.float32, seed=0)
    prompt = torch.randint(0, int(hf_config["vocab_size"]), (sizes.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=COMPILE_CHECK_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("off", "on"):
        config = EngineConfig.from_flat(model=TINY_PRESET, device=device.type, dtype="float32", compile=mode, max_num_seqs=1,
                                        max_model_len=sizes.prompt_len + COMPILE_CHECK_TOKENS + 1)
        engine = Engine.from_model(model, config, device)
        try:
            if mode == "on":
                engine.warm_up()  # compiles every step form now, and raises where one fails
            tokens[mode] = engine.generate(prompt, params).token_ids
        except Exception as exc:  # noqa: BLE001 - the finding: compiling does not work here
            if mode == "off":
                raise
            return Check(SECTION, "compiled_vs_eager", FAIL, f"compiling the decode step failed: "
                         f"{describe_failure(exc)}", {"compiled": False})
        finally:
            torch.compiler.reset()
        if engine.compile_state == "failed":
            return Check(SECTION, "compiled_vs_eager", FAIL, "the compiled step failed and the engine went eager "
                         "(see the warning above)", {"compiled": False})
    same = next((i for i, (a, b) in enumerate(zip(tokens["on"], tokens["off"], strict=True)) if a != b),
                COMPILE_CHECK_TOKENS)
    status = PASS if tokens["on"] == tokens["off"] else FAIL
    return Check(SECTION, "compiled_vs_eager", status,
                 f"compiled; {same} of {COMPILE_CHECK_TOKENS} greedy tokens equal to eager's (float32)",
                 {"compiled": True, "tokens_compiled": tokens["on"], "tokens_eager": tokens["off"]})


def check_flex_compiled(device: torch.device, dtype: torch.dtype, sizes: DecodeSizes) -> Check:
    if device.type != "cuda":
        return Check(SECTION, "flex_decode_compiled", SKIP, "the engine uses compiled flex decode on CUDA only")
    if not sizes.compile:
        return Check(SECTION, "flex_decode_compiled", SKIP, "skipped with --quick")
    ok, why = probe_compiled(str(device), dtype, 16)
    return Check(SECTION, "flex_decode_compiled", PASS if ok else FAIL, why)


def device_memory_bytes(device: torch.device) -> int | None:
    """What the model and its KV cache may use on the device; None on the CPU (no preset is run there)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return None


@functools.cache
def preset_weight_bytes(name: str, dtype: torch.dtype, quantize: str) -> int:
    """All weights of a preset as stored, counted on the meta device (nothing is allocated)."""
    hf_config = load_preset(name).hf_config
    return measure.total_weight_bytes(empty_model(hf_config, "meta", dtype, None if quantize == "none" else quantize))


def fitting_preset(device: torch.device, dtype: torch.dtype) -> tuple[str | None, str | None, str]:
    """(preset, quantize, why): the smallest real-size preset whose weights fit with the KV allowance, in the
    model dtype if one does, else in FP8."""
    memory = device_memory_bytes(device)
    if memory is None:
        return None, None, ("skipped: no preset fits a CPU-only run (real model shapes decode too slowly on the "
                            "CPU; the tiny model above runs the whole stack)")
    budget = int(memory * (1 - KV_ALLOWANCE))
    names = [n for n in available_presets() if n != TINY_PRESET]
    for quantize in ("none", "fp8"):
        sized = sorted((preset_weight_bytes(n, dtype, quantize), n) for n in names)
        for num_bytes, name in sized:
            if num_bytes <= budget:
                return name, quantize, (f"{name} ({quantize}): {num_bytes / 1e9:.1f} GB of weights, "
                                        f"{memory / 1e9:.1f} GB usable")
    smallest = min(preset_weight_bytes(n, dtype, "fp8") for n in names)
    return None, None, (f"skipped: no preset fits: the smallest needs {smallest / 1e9:.1f} GB in FP8, "
                        f"{budget / 1e9:.1f} GB of {memory / 1e9:.1f} GB is left after the KV allowance")


def check_bench_decode(device: torch.device, preset: str, quantize: str, sizes: DecodeSizes, copy: Copy,
                       note: str = "", compiled: bool = True) -> Check:
    """A short bench at batch 1: decode tok/s, kernels per step and the roofline fraction. `compiled=False`: the
    eager step, the speed served while the compiled one is built (a preset's cold compile takes minutes)."""
    from server.bench.run import run_bench

    opts = BenchOptions(preset=preset, batch_sizes=(1,), prompt_len=sizes.prompt_len,
                        decode_tokens=sizes.decode_tokens, device=device.type, quantize=(quantize,),
                        reps=sizes.reps, copy_mib=copy.mib, copy_gb_s=copy.gb_s,
                        engine_options={} if compiled else {"compile": "off"})
    record = run_bench(opts)[0]
    rate = record["decode_tok_s"]
    ok = math.isfinite(rate) and rate > 0
    kernels = record["kernels_per_step"]
    detail = (f"{rate:.1f} tok/s, {record['roofline_fraction']:.1%} of the copy-bandwidth roofline, "
              f"{'uncounted' if kernels is None else kernels} kernels/step ({record['kernels_counted_by']}), "
              f"first call {record['first_call_s']:.1f} s" + ("" if compiled else ", eager step")
              + (f"; {note}" if note else ""))
    values = {key: record[key] for key in ("decode_tok_s", "roofline_fraction", "kernels_per_step",
                                           "kernels_counted_by", "ms_per_token", "first_call_s", "dtype",
                                           "weight_bytes_per_token", "copy_gb_s", "cuda_graphs")}
    return Check(SECTION, f"decode_{preset}", PASS if ok else FAIL, detail,
                 {**values, "quantize": quantize, "compiled": compiled})
