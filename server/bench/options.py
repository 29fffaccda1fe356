"""The `mps-serve bench` command line (argparse only: building the parser must stay import-light)."""

from __future__ import annotations

import argparse
import importlib.util
import tomllib
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BATCH_SIZES = (1, 4, 16)
DEFAULT_PROMPT_LEN = 128
DEFAULT_DECODE_TOKENS = 128
QUANTIZATIONS = ("none", "fp8", "int8", "int4")
GRAPH_MODES = {"on": True, "off": False}
COPY_MIB = {"cuda": 4096, "mps": 1024, "cpu": 256}  # copy-bandwidth buffer per device type, past any cache
COMPARE_INSTALL = "pip install 'mps-serve[compare]'"  # the extra that brings transformers

EPILOG = """\
Measures through the real Engine: prefill tok/s = B * prompt_len / time(generate 1 token); steady decode
tok/s = B * (n_long - n_short) / (t_long - t_short) with n_long = decode_tokens + 1, n_short = decode_tokens/2 + 1
(65 and 129 for 128), best of --reps, after one warm-up call whose extra
time is reported as compile_s. Weights are read once per decode step, so achieved GB/s = bytes per step / step
time, and roofline_fraction = achieved GB/s / the device copy GB/s measured in the same run.
kernels/step: device kernels of one steady decode step, counted by torch.profiler after the timed calls (CUDA
kernel records on CUDA, graph replays included; elsewhere ATen ops that do device work, as a stand-in);
kernel ms: their summed durations on CUDA, the step's device time (the rest of ms/tok is host time or idle).
--graphs on,off measures our engine with and without CUDA graphs side by side (a Mac has none: "off" is the
Mac-like mode on CUDA); --no-graphs is --graphs off.
With --compare transformers, ours is measured first and freed, then transformers runs the same weights
(static cache + torch.compile on CUDA, eager elsewhere) and is measured the same way.

examples:
  mps-serve bench --preset tiny-moe --device cpu --batch-sizes 1,2 --compare transformers
  mps-serve bench --preset llama-3.1-8b --batch-sizes 1,4,16 --json perf.jsonl --compare transformers
  mps-serve bench --preset llama-3.1-8b --batch-sizes 1,16 --graphs on,off --json perf.jsonl
  mps-serve bench Qwen/Qwen3-30B-A3B --batch-sizes 1 --json perf.jsonl
"""


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None
    preset: str | None = None
    num_layers: int | None = None  # a preset cut to its first N layers: per-layer figures at a fraction of the compile
    batch_sizes: tuple[int, ...] | None = None  # None: the preset's, else DEFAULT_BATCH_SIZES
    prompt_len: int | None = None
    decode_tokens: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantize: tuple[str, ...] = ("none",)  # each measured in turn, side by side with one peer
    graphs: tuple[bool | None, ...] = (None,)  # EngineConfig.compilation.cuda_graphs of each measured mode; None: the config's
    json_path: str | None = None
    compare: str | None = None  # None | "transformers"
    peer_experts: str = "keep-grouped"  # keep-grouped | transformers-default | best
    reps: int = 3
    seed: int = 0
    copy_mib: int | None = None  # None: a size per device type
    copy_gb_s: float | None = None  # the caller's measured copy bandwidth (selfcheck's), used rather than measured again
    config_file: str | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return values


def _quantize_list(text: str) -> tuple[str, ...]:
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in values if v not in QUANTIZATIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"--quantize takes {', '.join(QUANTIZATIONS)} or a comma list of them, got {text!r}")
    return values


def _graph_modes(text: str) -> tuple[bool, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names or any(n not in GRAPH_MODES for n in names):
        raise argparse.ArgumentTypeError(f"--graphs takes on, off or on,off, got {text!r}")
    return tuple(GRAPH_MODES[n] for n in names)


def engine_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an EngineConfig field), got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]  # numbers, true/false, quoted strings
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def add_bench_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench",
        parents=parents,
        help="decode/prefill speed, fraction of the memory-bandwidth roofline, speedup over transformers",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("model", nargs="?", default=None, help="checkpoint directory or Hub repo id (default: none; give MODEL or --preset)")
    bench.add_argument("--preset", default=None, help="server/configs/presets/NAME.toml or a .toml path: real shapes, random weights (default: none)")
    bench.add_argument("--num-layers", type=int, default=None,
                       help="with --preset: keep only the first N decoder layers (full widths), for per-layer "
                            "figures at a fraction of the compile time (default: all)")
    bench.add_argument("--batch-sizes", type=_int_list, default=None, help="comma-separated (default: the preset's, else 1,4,16)")
    bench.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence (default: the preset's, else 128)")
    bench.add_argument("--decode-tokens", type=int, default=None, help="new tokens per sequence (default: the preset's, else 128)")
    bench.add_argument("--device", choices=["auto", "mps", "cuda", "cpu"], default="auto",
                       help="where the model runs; auto picks mps, then cuda, then cpu (default: auto)")
    bench.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                       help="auto: the checkpoint's on an accelerator, float32 on the cpu (default: auto)")
    bench.add_argument("--quantize", type=_quantize_list, default=("none",),
                       help="none, fp8, or both as none,fp8 (measured in turn, side by side with one peer) (default: none)")
    graphs = bench.add_mutually_exclusive_group()
    graphs.add_argument("--graphs", type=_graph_modes, default=(None,), metavar="on|off|on,off",
                        help="our decode steps with CUDA graphs, without (the Mac-like mode: each kernel launched "
                             "from the host), or both measured in turn, side by side (default: the config's, on "
                             "where the compiled decode step runs on CUDA)")
    graphs.add_argument("--no-graphs", dest="graphs", action="store_const", const=(False,),
                        help="the same as --graphs off (default: graphs as --graphs says)")
    bench.add_argument("--json", dest="json_path", default=None, help="append one JSON object per batch size to this file (default: none)")
    bench.add_argument("--compare", choices=["transformers"], default=None,
                       help=f"also measure transformers on the same weights; needs {COMPARE_INSTALL} (default: none)")
    bench.add_argument("--peer-experts", choices=["keep-grouped", "transformers-default", "best"],
                       default="keep-grouped",
                       help="MoE peer on GPUs: keep grouped_mm experts in decode (its fastest compiled form where "
                            "measured), transformers' own switch to batched_mm, or measure both and keep the best (default: keep-grouped)")
    bench.add_argument("--reps", type=int, default=3, help="timed repetitions per length; the minimum is kept (default: 3)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: 0)")
    bench.add_argument("--copy-mib", type=int, default=None, help="size of the copy-bandwidth buffer in MiB (default: "
                            + ", ".join(f"{mib} on {kind}" for kind, mib in COPY_MIB.items()) + ")")
    bench.add_argument("--config", dest="config_file", default=None, help="TOML with an [engine] table (default: none)")
    bench.add_argument("--engine-option", action="append", type=engine_option, default=[], metavar="KEY=VALUE",
                       help="EngineConfig field override, e.g. compile=off (repeatable; default: none)")
    return bench


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    if (args.model is None) == (args.preset is None):
        from server.bench.presets import available_presets

        raise ValueError(
            "bench needs a MODEL (checkpoint directory or Hub repo id) or --preset NAME, not both; presets: "
            + ", ".join(available_presets())
        )
    if args.compare == "transformers" and importlib.util.find_spec("transformers") is None:
        raise ValueError(f"--compare transformers needs the transformers package, which is not installed: "
                         f"{COMPARE_INSTALL}")
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    if args.graphs != (None,) and any(key == "cuda_graphs" for key, _ in args.engine_option):
        raise ValueError("give the graph modes with --graphs or --no-graphs, not --engine-option cuda_graphs=...")
    if args.num_layers is not None and (args.preset is None or args.num_layers < 1):
        raise ValueError(f"--num-layers takes a positive count and needs --preset, got {args.num_layers}")
    if args.prompt_len is not None and args.prompt_len < 1:
        raise ValueError(f"--prompt-len must be at least 1, got {args.prompt_len}")
    return BenchOptions(
        model=args.model,
        preset=args.preset,
        num_layers=args.num_layers,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        decode_tokens=args.decode_tokens,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        graphs=args.graphs,
        json_path=args.json_path,
        compare=args.compare,
        peer_experts=args.peer_experts,
        reps=args.reps,
        seed=args.seed,
        copy_mib=args.copy_mib,
        config_file=args.config_file,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        engine_options=dict(args.engine_option),
    )
