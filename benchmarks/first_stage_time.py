"""Seconds of the first background-compile stage alone (one sequence's decode step, as `serve` builds it first),
nothing served beside it; with --profile, where they go (cProfile, by cumulative time).

    PYTHONPATH=. python3 benchmarks/first_stage_time.py --preset tiny-moe --cache-dir /tmp/fs   # cold
    PYTHONPATH=. python3 benchmarks/first_stage_time.py --preset tiny-moe --cache-dir /tmp/fs   # warm

The second run finds the compile cache the first one filled, as a restart does. Random weights, the model's dtype
on the auto-selected device, CUDA graphs off (the Mac-like mode, whose first stage is inductor's Python wrapper).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR for this run")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest calls")
    args = parser.parse_args(argv)
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
    config = EngineConfig(model=args.preset, device=device.type, compile="on", cuda_graphs=False, max_model_len=4096)
    engine = Engine.from_model(build_random_model(hf_config, device, dtype, 0), config, device)
    what, run = engine._warm_up_stages(engine.runner, beside_serving=True)[0]
    profile = cProfile.Profile()
    start = time.perf_counter()
    if args.profile:
        profile.enable()
    run()
    profile.disable()
    print(json.dumps({"preset": args.preset, "device": device.type, "torch_version": torch.__version__,
                      "cache": "warm" if warm_cache else "cold", "stage": what,
                      "stage_s": round(time.perf_counter() - start, 1), "profiled": bool(args.profile)}), flush=True)
    if args.profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
