"""How long the warm-up of the compiled steps takes (Engine.warm_up: compile and capture the decode step; `serve`
runs the same beside serving), with a cold and then a warm compile cache.

    PYTHONPATH=. python3 benchmarks/warmup_time.py --preset llama-3.1-8b --cache-dir /tmp/inductor   # cold
    PYTHONPATH=. python3 benchmarks/warmup_time.py --preset llama-3.1-8b --cache-dir /tmp/inductor   # warm

The second run finds inductor's on-disk caches, as a restart of the server finds ~/.cache/mps-serve/inductor-3
(the directory `mps-serve` sets as TORCHINDUCTOR_CACHE_DIR). Random weights, the serve defaults (16 sequences).
With --serve-path it starts as `serve` does (the compile on a thread of its own) and reports the first token's
seconds after the weights are loaded, when one sequence's steps run compiled (the first warm-up stage), when
every stage is ready, and the decode rates on the way. Prints a JSON line at each of those points, the last one
complete. With --checkpoint the weights stream from disk through `serve`'s loader, and the compile child starts
before they do (`--compile-child late`: after, for comparison); seconds still count from the end of the load,
which `build_s` times. --eager-only measures the eager decode rate before the compile starts
(`eager_tok_s_alone`) and stops after the rate while compiling: what the compile costs the eager path.
--first-stage times the first background-compile stage alone (one sequence's decode step as `serve` builds it
first), nothing served beside it; --profile N then prints its N costliest calls (cProfile).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR for this run")
    parser.add_argument("--serve-path", action="store_true",
                        help="compile in the background as `serve` does; time the first token and the compiled rate")
    parser.add_argument("--eager-only", action="store_true",
                        help="with --serve-path: stop after the eager rates (alone, and while compiling)")
    parser.add_argument("--graphs", choices=["on", "off"], default="on",
                        help="off: no CUDA graph replays the decode step (the Mac-like mode), whose steps launch "
                             "from inductor's Python wrapper first and from its C++ wrapper after the last stage")
    parser.add_argument("--checkpoint", default=None,
                        help="load this checkpoint from disk as `serve` does (benchmarks/write_checkpoint.py writes "
                             "one of a preset) instead of building the preset's random weights on the device")
    parser.add_argument("--compile-child", choices=["on", "late", "off"], default="on",
                        help="with --serve-path: on starts it as `serve` does (with --checkpoint before the weights "
                             "load), late once they are loaded (as before), off compiles in the serving process, "
                             "for comparison (the child only starts where the cache lacks the stages)")
    parser.add_argument("--first-stage", action="store_true",
                        help="time the first background-compile stage alone, nothing served beside it")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="with --first-stage: print the N costliest calls of the stage")
    parser.add_argument("--switch-interval-us", type=float, default=None,
                        help="the GIL switch interval while compiling beside serving, for this measurement only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the stages as they end
    cache = Path(args.cache_dir)
    warm_cache = cache.is_dir() and any(cache.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before torch is imported

    import torch

    from server.bench.presets import load_preset
    from server.bench.random_model import build_random_model
    from server.config import EngineConfig
    from server.engine import device as device_mod
    from server.engine.engine import Engine

    hf_config = load_preset(args.preset).hf_config
    device, _ = device_mod.select_device("auto")
    dtype = device_mod.select_dtype("auto", device, hf_config.get("torch_dtype"))
    if args.compile_child == "off":
        import server.engine.compiled_steps

        server.engine.compiled_steps.start_compile_child = lambda spec, stages: None
    start = time.perf_counter()
    config = EngineConfig(model=args.checkpoint or args.preset, device=device.type, compile="on",
                          cuda_graphs=args.graphs == "on", max_model_len=4096)
    if args.checkpoint:
        engine = Engine.from_config(config, compile_beside_serving=args.serve_path and args.compile_child == "on")
    else:
        engine = Engine.from_model(build_random_model(hf_config, device, dtype, 0), config, device)
    built_s = time.perf_counter() - start
    record = {"preset": args.preset, "device": device.type, "torch_version": torch.__version__, "graphs": args.graphs,
              "cache": "warm" if warm_cache else "cold", "build_s": round(built_s, 1),
              "weights": "loaded from disk" if args.checkpoint else "random, built on the device"}
    if args.switch_interval_us is not None:
        from server.engine import background_compile

        background_compile.SERVING_SWITCH_INTERVAL_S = args.switch_interval_us * 1e-6
        record["switch_interval_us"] = args.switch_interval_us
    record["compile_child"] = args.compile_child
    if args.serve_path:
        if not serve_path(engine, hf_config["vocab_size"], record, args.eager_only):
            return 0
    elif args.first_stage:
        record.update(first_stage(engine, args.profile))
    else:
        record.update({"warm_up_s": round(engine.warm_up(), 1),
                       "decode_shapes_captured": len(engine.runner.decode_graphs.graphs)})
    print(json.dumps(record), flush=True)
    return 0


def first_stage(engine, profile_top: int) -> dict:
    """The first background-compile stage alone; with `profile_top`, where its time goes."""
    import cProfile
    import pstats

    what, run = engine._warm_up_stages(engine.runner, beside_serving=True)[0]
    profile = cProfile.Profile()
    start = time.perf_counter()
    if profile_top:
        profile.enable()
    run()
    profile.disable()
    seconds = time.perf_counter() - start
    if profile_top:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(profile_top)
    return {"stage": what, "stage_s": round(seconds, 1), "profiled": bool(profile_top)}


def serve_path(engine, vocab_size: int, record: dict, eager_only: bool) -> bool:
    """As `serve` starts: the compile on its own thread, a request answered meanwhile on the eager path; then the
    decode rate once the engine has moved to the compiled step. Seconds count from the weights being loaded
    (--eager-only: from the compile's start, after the eager rate alone). The first token's line is printed at
    once (`"partial": true`), so a run cut off while compiling still reports it. Whether it went on past the
    eager rates."""
    import torch

    from server.engine.types import SamplingParams

    prompt = torch.randint(0, vocab_size, (128,)).tolist()
    if eager_only:  # the eager path's own rate, to set beside its rate while compiling
        # On the runner compile_in_background serves from meanwhile: the engine's own would compile lazily.
        from server.engine.model_runner import ModelRunner

        compiled_runner = engine.runner
        engine.runner = ModelRunner(engine.model, engine.kv_cache, engine.device, engine.vocab_size, None,
                                    engine.state_cache, compiled_runner.plans)
        decode_rate(engine, prompt, 8)  # the eager path's own first-call costs
        record["eager_tok_s_alone"] = round(decode_rate(engine, prompt, 32), 1)
        engine.runner = compiled_runner
        print(json.dumps({**record, "partial": True}), flush=True)  # a run cut while compiling still says this
    start = time.perf_counter()
    background = engine.compile_in_background()
    engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first_token_s = time.perf_counter() - start
    record.update(first_token_s=round(first_token_s, 2),
                  eager_tok_s_while_compiling=round(decode_rate(engine, prompt, 32), 1))
    print(json.dumps({**record, "partial": True}), flush=True)
    if eager_only:
        return False
    while not (background.first_stage_ready or background.join(0.05)):
        pass
    record["one_sequence_compiled_s"] = round(time.perf_counter() - start, 1)  # its steps run compiled from here
    decode_rate(engine, prompt, 8)  # the step that moves the engine to the compiled runner
    record["one_sequence_tok_s"] = round(decode_rate(engine, prompt, 128), 1)
    record["one_sequence_launch"] = engine.runner.kernel_launch
    print(json.dumps({**record, "partial": True}), flush=True)
    background.join()
    record["compiled_ready_s"] = round(time.perf_counter() - start, 1)
    decode_rate(engine, prompt, 8)  # the step that moves the engine to the compiled runner
    record.update(compile_state=engine.compile_state, compiled_tok_s=round(decode_rate(engine, prompt, 128), 1),
                  compiled_launch=engine.runner.kernel_launch)
    if background.error is not None:
        record["compile_error"] = background.error
    return True


def decode_rate(engine, prompt: list[int], num_tokens: int) -> float:
    """Decode tokens per second: a run of `num_tokens` less a one-token run, so the prefill drops out."""
    from server.engine.types import SamplingParams

    seconds = []
    for max_tokens in (1, num_tokens):
        begin = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        seconds.append(time.perf_counter() - begin)
    return (num_tokens - 1) / (seconds[1] - seconds[0])


if __name__ == "__main__":
    sys.exit(main())
