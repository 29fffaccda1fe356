"""Can a compile on fake tensors (no weights, no KV cache memory) fill inductor's cache for the real one? The
question behind moving the background compile out of the serving process, whose GIL it shares (issue 19).

    PYTHONPATH=. python3 benchmarks/fake_compile_cache.py --preset tiny-moe --graphs off

Three processes, each building the engine as `serve` does (random weights) and running the first warm-up stage
(the decode step of one sequence): `fill`, the model's parameters and buffers as FakeTensors of the real shapes,
dtypes and device, its graphs handed to inductor (which writes its caches) but run as FX code on the fakes;
`filled`, the real model in the cache `fill` left; `cold`, the real model in an empty cache. One JSON line each:
the stage's seconds and inductor's FX graph cache hits and misses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe", help="a preset name or a path to a .toml preset")
    parser.add_argument("--graphs", choices=["on", "off"], default="off")
    parser.add_argument("--role", choices=["fill", "filled", "cold"], help="run one role in this process")
    parser.add_argument("--cache-dir", help="TORCHINDUCTOR_CACHE_DIR of --role")
    args = parser.parse_args(argv)
    if args.role is not None:
        print(json.dumps(run_role(args.role, args.preset, args.graphs, args.cache_dir)), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as filled, tempfile.TemporaryDirectory() as cold:
        for role, cache in (("fill", filled), ("filled", filled), ("cold", cold)):
            subprocess.run([sys.executable, __file__, "--preset", args.preset, "--graphs", args.graphs, "--role",
                            role, "--cache-dir", cache], check=True)
    return 0


def run_role(role: str, preset: str, graphs: str, cache_dir: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch is imported
    import torch
    from torch._dynamo.utils import counters

    from server.bench.presets import load_preset
    from server.bench.random_model import build_random_model
    from server.config import EngineConfig
    from server.engine import device as device_mod
    from server.engine.engine import Engine

    hf_config = load_preset(preset).hf_config
    device, _ = device_mod.select_device("auto")
    dtype = device_mod.select_dtype("auto", device, hf_config.get("torch_dtype"))
    config = EngineConfig(model=preset, device=device.type, compile="on", cuda_graphs=graphs == "on")
    if role == "fill":
        from torch._subclasses.fake_tensor import FakeTensorMode

        from server.engine.compile_worker import fake_model, fill_caches_on_compile

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fill_caches_on_compile()
        model = fake_model(hf_config, device, dtype, fake_mode, None)
    else:
        fake_mode = None
        model = build_random_model(hf_config, device, dtype, 0)
    with fake_mode or contextlib.nullcontext():
        engine = Engine.from_model(model, config, device, max_model_len=4096)
        what, run = engine._warm_up_stages(engine.runner, beside_serving=True)[0]
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    inductor = counters["inductor"]
    return {"role": role, "preset": preset, "device": device.type, "torch_version": torch.__version__,
            "stage": what, "stage_s": round(seconds, 1), "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
            "fxgraph_cache_miss": inductor["fxgraph_cache_miss"]}


if __name__ == "__main__":
    sys.exit(main())
