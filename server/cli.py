"""The `mps-serve` command: serve, generate, bench, info."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import logging
import os
import sys
import tomllib
from pathlib import Path

from server.config import load_config
from server.engine.types import EngineError

log = logging.getLogger(__name__)


def _add_model_args(parser: argparse.ArgumentParser, model_required: bool) -> None:
    if model_required:
        parser.add_argument("model", help="local Hugging Face checkpoint directory, Hub repo id, or 'demo'")
    else:
        parser.add_argument("model", nargs="?", default=None, help="checkpoint directory or Hub repo id (default: demo)")
    parser.add_argument("--device", choices=["auto", "mps", "cuda", "cpu"], default=None)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--quantize", choices=["none", "fp8"], default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="threads of torch's CPU ops (default: half the cores, at most 8)")
    parser.add_argument("--config", default=None,
                        help="TOML file with [engine] and [server] tables (see server/configs/)")


def _engine_overrides(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantize,  # "none" overrides a config file's fp8; EngineConfig normalizes it
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "cpu_threads": args.cpu_threads,
    }


def installed_version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, pyproject.toml's."""
    try:
        return importlib.metadata.version("mps-serve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, tomllib.TOMLDecodeError, KeyError):
            return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mps-serve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_model_args(serve, model_required=False)
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--no-warmup", action="store_true",
                       help="do not compile the decode step beside serving at start-up; the first requests then "
                            "wait for it to compile")
    serve.add_argument("--allowed-origins", default=None, help="comma-separated CORS origins (CORS is off by default)")

    gen = sub.add_parser("generate", help="generate text once and print it")
    _add_model_args(gen, model_required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)

    from server.bench.options import add_bench_parser  # argparse only; the bench itself loads lazily

    add_bench_parser(sub)

    info = sub.add_parser("info", help="device, why MPS is or is not available, which fast paths are enabled")
    info.add_argument("--device", choices=["auto", "mps", "cuda", "cpu"], default="auto")
    info.add_argument("--compile-probes", action="store_true",
                      help="also compile and check the compiled-only paths (flex decode attention)")
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
    for line in capabilities(device).describe():
        print(f"  {line}")
    if args.compile_probes:  # these compile on the device, so they take seconds to a minute
        from server.engine.device import select_dtype
        from server.kernels.flex_decode import probe_compiled

        ok, why = probe_compiled(str(device), select_dtype("auto", device, None), 16)
        print(f"  {'flex_decode':<22} {'yes' if ok else 'no ':<4} {why}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from server.api.server import run_server
    from server.engine.async_engine import AsyncEngine

    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()) if args.allowed_origins else None
    server_overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "served_model_name": args.served_model_name,
        "allowed_origins": origins,
        "log_level": args.log_level,
        "warmup": False if args.no_warmup else None,
    }
    config = load_config(args.config, engine=_engine_overrides(args), server=server_overrides)

    def build_engine() -> AsyncEngine:
        engine = AsyncEngine.from_config(config.engine, config.server.max_waiting_requests)
        if config.server.warmup:
            engine.compile_in_background()
        freeze_startup_objects()
        return engine

    return run_server(config, build_engine)


def freeze_startup_objects() -> None:
    """Move what start-up left alive (model, compiled graphs, dynamo's caches) out of the cyclic GC's reach.
    Else the first full collection while serving walks all of it with the GIL held, and no stream advances
    until it is done."""
    gc.collect()
    gc.freeze()
    log.info("start-up objects frozen for the garbage collector: %d", gc.get_freeze_count())


def cmd_bench(args: argparse.Namespace) -> int:
    from server.bench.run import cmd_bench as run_bench

    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Compiled graphs persist in the user cache (not /tmp), so a restart skips most of the compile. The suffix
    # moves on whenever graphs cached by an older mps-serve could be wrong here: inductor's cache keys miss some
    # inputs of a graph, such as the SDPA backend flags that paged_attention.prefill_sdpa_backends sets.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "mps-serve" / "inductor-3"))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "info": cmd_info, "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except (ValueError, EngineError) as exc:  # configuration and request errors carry a message that says what to fix
        print(f"mps-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
