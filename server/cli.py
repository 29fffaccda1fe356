"""The `mps-serve` command: serve, generate, bench, info, selfcheck."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import textwrap
from pathlib import Path

from collections.abc import Callable
from typing import TYPE_CHECKING

from server.config import Config, EngineConfig, ModelConfig, ServerConfig, load_config
from server.engine.types import EngineError
from server.version import installed_version

if TYPE_CHECKING:
    from server.api.model_registry import ModelRegistry
    from server.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


ENGINE_DEFAULTS = EngineConfig()
SERVER_DEFAULTS = ServerConfig()
DEVICES = ["auto", "mps", "cuda", "cpu"]
LOG_LEVELS = ["debug", "info", "warning", "error"]


def _add_model_args(parser: argparse.ArgumentParser, several: bool = False) -> None:
    parser.add_argument("model", nargs="*" if several else "?", default=None,
                        help="local Hugging Face checkpoint directory, Hub repo id, or 'demo' (default: the config "
                             f"file's model, else {ENGINE_DEFAULTS.load.model}: a tiny random-weight model, no download)"
                             + ("; several: each loads on the first request that names it" if several else ""))
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help=f"where the model runs; auto picks mps, then cuda, then cpu (default: {ENGINE_DEFAULTS.load.device})")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=None,
                        help="weight and activation dtype; auto: the checkpoint's on an accelerator, float32 on the "
                             f"cpu (default: {ENGINE_DEFAULTS.load.dtype})")
    parser.add_argument("--quantize", choices=["none", "fp8", "int8", "int4"], default=None,
                        help="fp8: every linear and expert weight stored in FP8, about half the bytes of bf16; "
                             "int4 / int8: MLX's affine format (groups of 64), quantized at load; an MLX checkpoint "
                             "loads as it is stored (default: none)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"sequences decoded together (default: {ENGINE_DEFAULTS.scheduler.max_num_seqs})")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="threads of torch's CPU ops (default: half the cores the process may use, at most 8)")
    parser.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                        help="a disk tier under the prefix cache: KV blocks (and hybrid states) evicted from memory "
                             "are written here and read back for a later prompt with that prefix, also after a "
                             "restart (default: none, memory only)")
    parser.add_argument("--prefix-cache-disk-gb", type=float, default=None, metavar="GB",
                        help="the disk tier's budget per model; least recently used files go first "
                             f"(default: {ENGINE_DEFAULTS.cache.prefix_cache_disk_gb:g})")
    parser.add_argument("--config", default=None,
                        help="TOML file with [engine] and [server] tables; flags override it (default: none; "
                             "server/configs/default.toml is an example)")
    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="split every layer over N processes started by torchrun (fast links: NVLink) "
                             "(default: 1)")
    parser.add_argument("--pipeline-parallel", type=int, default=None, metavar="N",
                        help="split the layers into N contiguous ranges, one per process started by torchrun "
                             "(slower links: several Macs over Thunderbolt or Ethernet) (default: 1)")


def _engine_overrides(args: argparse.Namespace) -> dict:
    return {
        "model": args.model[0] if isinstance(args.model, list) and args.model else args.model or None,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantize,  # "none" overrides a config file's fp8; EngineConfig normalizes it
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "tensor_parallel": args.tensor_parallel,
        "pipeline_parallel": args.pipeline_parallel,
        "cpu_threads": args.cpu_threads,
        "prefix_cache_dir": args.prefix_cache_dir,
        "prefix_cache_disk_gb": args.prefix_cache_disk_gb,
    }


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _global_flags(default) -> argparse.ArgumentParser:
    """Flags accepted before the command and after it; the subcommands' copies default to SUPPRESS, so a flag
    given before the command is not reset by the subcommand's parser."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                       help=f"logging threshold (default: {SERVER_DEFAULTS.log_level})")
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mps-serve", description=__doc__, parents=[_global_flags("info")])
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_global_flags(argparse.SUPPRESS)]

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server", parents=common)
    _add_model_args(serve, several=True)
    serve.add_argument("--host", default=None, help=f"bind address (default: {SERVER_DEFAULTS.host})")
    serve.add_argument("--port", type=_port, default=None, help=f"TCP port (default: {SERVER_DEFAULTS.port})")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on the /v1 endpoints "
                            "(default: none, open)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name /v1/models lists (default: the MODEL argument)")
    serve.add_argument("--no-warmup", action="store_true",
                       help="do not compile the decode step beside serving at start-up; the first requests then "
                            "wait for it to compile (default: compile at start-up)")
    serve.add_argument("--warm-prompts", default=None, metavar="FILE",
                       help='JSON Lines of prompts to prefill into the prefix cache at start-up, one per line: '
                            '{"messages": [...], "tools": [...]} or {"prompt": "text"} (default: none)')
    serve.add_argument("--allowed-origins", default=None,
                       help="comma-separated CORS origins (default: none, CORS off)")
    serve.add_argument("--shutdown-grace", type=_seconds, default=None, metavar="SECONDS",
                       help="on Ctrl-C / SIGTERM, how long streams in flight get to finish before they are aborted; "
                            f"a second Ctrl-C exits at once (default: {SERVER_DEFAULTS.shutdown_grace_s:g})")
    serve.add_argument("--keep-alive", type=float, default=None, metavar="SECONDS",
                       help="with several models: how long one stays loaded after its last request; negative: "
                            f"until evicted (default: {SERVER_DEFAULTS.keep_alive_s:g})")
    serve.add_argument("--models-memory-gb", type=float, default=None, metavar="GB",
                       help="with several models: the memory all loaded ones may take together; the least recently "
                            "used idle one is unloaded to make room (default: the recommended working set on a Mac, "
                            "the GPU's memory on CUDA, physical memory on the CPU)")

    gen = sub.add_parser("generate", help="generate text once and print it (no server)", parents=common)
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (required)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template (default: plain text prompt)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0, off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")

    from server.bench.options import add_bench_parser  # argparse only; the bench itself loads lazily

    add_parallel_args(add_bench_parser(sub, common))
    check = sub.add_parser("selfcheck", parents=common,
                           help="every fast path against its reference on this machine, speeds and a short decode; "
                                "a PASS/FAIL table and a summary line for bug reports")
    check.add_argument("--device", choices=DEVICES, default="auto",
                       help="the device to check; auto picks mps, then cuda, then cpu (default: auto)")
    check.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                       help="also write every check and the system details to this JSON file (default: none)")
    check.add_argument("--quick", action="store_true",
                       help="small sizes, no compile and no real-size preset: seconds instead of a minute or two "
                            "(default: the full check)")
    check.add_argument("--seed", type=int, default=None,
                       help="seed of the random inputs, to replay a failure (default: a fresh one, printed)")

    info = sub.add_parser("info", help="device, why MPS is or is not available, which fast paths are enabled; "
                                       "with MODEL, its weight size in bf16, FP8, int8 and int4", parents=common)
    info.add_argument("model", nargs="?", default=None,
                      help="a local checkpoint folder or Hub repo id: print its resident weight size in each "
                           "precision and the smallest Mac each fits, from config.json alone (a Hub model's "
                           "config.json is fetched, or read from the cache; nothing else is downloaded) "
                           "(default: none, the device report)")
    info.add_argument("--device", choices=DEVICES, default="auto", help="the device to probe (default: auto)")
    info.add_argument("--verbose", action="store_true",
                      help="show each failed probe's exception, not only its short reason (default: off)")
    info.add_argument("--compile-probes", action="store_true",
                      help="also compile and check the compiled-only paths (flex decode attention); takes seconds "
                           "to a minute (default: off)")
    from server.quantize_cli import add_quantize_parser  # argparse only; quantizing loads lazily

    add_quantize_parser(sub, common)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from server.engine.engine import Engine
    from server.engine.types import SamplingParams

    config = load_config(args.config, engine=_engine_overrides(args))
    engine = Engine.from_config(config.engine)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    if args.chat:
        out = engine.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = engine.generate(args.prompt, params)
    print(out.text)
    print(
        f"[{out.prompt_tokens} prompt tokens, {out.completion_tokens} generated, finish_reason={out.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.model is not None:
        from server.engine.model_size import model_info

        print("\n".join(model_info(args.model)))
        return 0
    import torch

    from server.engine.device import mps_unavailable_reason, select_device

    print(f"torch {torch.__version__}")
    reason = mps_unavailable_reason()
    print(f"MPS: {'available' if reason is None else 'not available: ' + reason}")
    print(f"CUDA: {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    device, why = select_device(args.device)
    print(f"device: {device} ({why})")
    try:
        from server.kernels.capabilities import capabilities
    except ImportError:
        return 0
    print("fast paths:")
    for line in capabilities(device).describe(verbose=args.verbose):
        print(readable(f"  {line}"))
    if args.compile_probes:  # these compile on the device, so they take seconds to a minute
        from server.engine.device import select_dtype
        from server.kernels.flex_probe import probe_compiled

        ok, why = probe_compiled(str(device), select_dtype("auto", device, None), 16)
        print(readable(f"    {'flex_decode':<22} {'yes' if ok else 'no ':<4} {why}"))
    from server.kernels.mps_ops import fallback_report

    print("\n".join(fallback_report(on_mps=device.type == "mps")))
    return 0


def readable(line: str, width: int = 110) -> str:
    """A probe line with a long reason wrapped under the reason's column, never cut."""
    indent = " " * (len(line) - len(line.lstrip()) + 28)  # past "name (22) yes/no (4)"
    return textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def cmd_serve(args: argparse.Namespace) -> int:
    from server.api.server import run_server

    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()) if args.allowed_origins else None
    server_overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "served_model_name": args.served_model_name,
        "allowed_origins": origins,
        "log_level": args.log_level,
        "warmup": False if args.no_warmup else None,
        "shutdown_grace_s": args.shutdown_grace,
        "warm_prompts": args.warm_prompts,
        "keep_alive_s": args.keep_alive,
        "models_memory_gb": args.models_memory_gb,
    }
    config = load_config(args.config, engine=_engine_overrides(args), server=server_overrides)
    if len(args.model or []) > 1 or config.models:
        return run_server(config, None, models=model_registry(config, args.model or []))
    return run_server(config, engine_builder(config, config.engine, freeze=True))


def engine_builder(config: Config, engine_config: EngineConfig, freeze: bool) -> Callable[[], AsyncEngine]:
    """The engine factory of `serve`: `freeze` only with one model, whose objects live as long as the process."""

    def build_engine() -> AsyncEngine:
        from server.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(engine_config, config.server.max_waiting_requests, config.server.warmup)
        if config.server.warm_prompts is not None:
            from server.engine.warm import warm_prefix_cache

            engine.call(lambda: warm_prefix_cache(engine.engine, config.server.warm_prompts))
        if config.server.warmup:
            engine.compile_in_background()
        if freeze:
            freeze_startup_objects()
        return engine

    return build_engine


def model_registry(config: Config, names: list[str]) -> ModelRegistry:
    """Several models: the MODEL arguments, then the [[models]] entries of the config file, each estimated
    (config.json only) for the memory budget and built on its first request."""
    from server.api.model_registry import ModelRegistry, ModelSpec
    from server.engine.device import memory_budget_bytes
    from server.engine.model_size import estimated_resident_bytes

    if config.server.served_model_name or config.server.model_aliases:
        raise ValueError("--served-model-name and model_aliases name the one model; with several, give each its "
                         "aliases in a [[models]] table")
    entries = [ModelConfig(model=name) for name in names] + list(config.models)
    specs = []
    for entry in entries:
        settings = {"model": entry.model, "quantization": entry.quantization or config.engine.load.quantization,
                    "max_model_len": entry.max_model_len or config.engine.scheduler.max_model_len}
        engine_config = config.engine.replace_flat(**settings)
        build = engine_builder(config, engine_config, freeze=False)
        specs.append(ModelSpec(entry.name or entry.model, entry.aliases, build, estimated_resident_bytes(engine_config)))
    gb = config.server.models_memory_gb
    budget = int(gb * 2**30) if gb is not None else memory_budget_bytes(config.engine.load.device)
    return ModelRegistry(specs, budget, config.server.keep_alive_s)


def freeze_startup_objects() -> None:
    """Move what start-up left alive (model, compiled graphs, dynamo's caches) out of the cyclic GC's reach.
    Else the first full collection while serving walks all of it with the GIL held, and no stream advances
    until it is done."""
    gc.collect()
    gc.freeze()
    log.info("start-up objects frozen for the garbage collector: %d", gc.get_freeze_count())


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from server.selfcheck.run import cmd_selfcheck as run_selfcheck

    return run_selfcheck(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from server.bench.run import cmd_bench as run_bench

    return run_bench(args)


def run_parallel(args: argparse.Namespace, handler, num_ranks: int) -> int:
    """One rank of a model split over `num_ranks` processes: rank 0 runs the command, the others follow it."""
    from server.engine import distributed

    if "RANK" not in os.environ:
        raise ValueError(f"--tensor-parallel / --pipeline-parallel {num_ranks} run one process per rank: start "
                         f"them with torchrun --nproc-per-node {num_ranks} -m server {args.command} ...")
    env = os.environ
    info = distributed.ProcessInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
    distributed.init(info, num_ranks, args.device)
    try:
        code = handler(args) if info.rank == 0 else distributed.follow()
    except BaseException as exc:  # noqa: B036 - every failure must end all ranks, Ctrl-C included
        distributed.abandon(exc)
    distributed.finish()
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Compiled graphs persist in the user cache (not /tmp), so a restart skips most of the compile. The suffix
    # moves on whenever graphs cached by an older mps-serve could be wrong here: inductor's cache keys miss some
    # inputs of a graph, such as the SDPA backend flags that paged_attention.prefill_sdpa_backends sets.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "mps-serve" / "inductor-3"))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.quantize_cli import cmd_quantize

    handlers = {"serve": cmd_serve, "generate": cmd_generate, "info": cmd_info, "bench": cmd_bench,
                "selfcheck": cmd_selfcheck, "quantize": cmd_quantize}
    try:
        num_ranks = max(getattr(args, "tensor_parallel", None) or 1, getattr(args, "pipeline_parallel", None) or 1)
        if num_ranks > 1:
            return run_parallel(args, handlers[args.command], num_ranks)
        return handlers[args.command](args)
    except (ValueError, EngineError) as exc:  # configuration and request errors carry a message that says what to fix
        print(f"mps-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def _port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port), as argparse checks its arguments: a bad one is a one-line error."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port
