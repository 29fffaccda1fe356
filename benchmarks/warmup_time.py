"""How long the warm-up of the compiled steps takes (Engine.warm_up: compile and capture the decode step; `serve`
runs the same beside serving), with a cold and then a warm compile cache.

    PYTHONPATH=. python3 benchmarks/warmup_time.py --preset llama-3.1-8b --cache-dir /tmp/inductor   # cold
    PYTHONPATH=. python3 benchmarks/warmup_time.py --preset llama-3.1-8b --cache-dir /tmp/inductor   # warm

The second run finds inductor's on-disk caches, as a restart of the server finds ~/.cache/mps-serve/inductor-3
(the directory `mps-serve` sets as TORCHINDUCTOR_CACHE_DIR). Random weights, the serve defaults (16 sequences).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR for this run")
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
    start = time.perf_counter()
    model = build_random_model(hf_config, device, dtype, 0)
    config = EngineConfig(model=args.preset, device=device.type, compile="on")
    engine = Engine.from_model(model, config, device, max_model_len=4096)
    built_s = time.perf_counter() - start
    warm_up_s = engine.warm_up()
    print(json.dumps({"preset": args.preset, "device": device.type,
                      "torch_version": torch.__version__, "cache": "warm" if warm_cache else "cold",
                      "build_s": round(built_s, 1), "warm_up_s": round(warm_up_s, 1),
                      "decode_shapes_captured": len(engine.runner.decode_graphs.graphs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
