"""What a busy Python thread beside serving costs the eager decode path, at several GIL switch intervals: the
background compile is such a thread (dynamo and inductor are Python), and every torch op the serving thread runs
releases the GIL and must win it back, waiting up to one switch interval when the other thread holds it.

    PYTHONPATH=. python3 benchmarks/gil_contention.py --preset tiny-moe [--device cpu]

Prints the eager decode rate alone, then beside a thread that only runs Python, per interval (median of 5 runs).
On the CPU the ops get one thread, so the Python thread and the ops do not also compete for cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import torch

from benchmarks.warmup_time import decode_rate
from server.bench.presets import load_preset
from server.bench.random_model import build_random_model
from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.engine import Engine

INTERVALS_S = (0.005, 0.0002, 0.00005, 0.00001)  # Python's default, the serving default while compiling, lower


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    hf_config = load_preset(args.preset).hf_config
    device, _ = device_mod.select_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = device_mod.select_dtype("auto", device, hf_config.get("torch_dtype"))
    model = build_random_model(hf_config, device, dtype, 0)
    engine = Engine.from_model(model, EngineConfig.from_flat(model=args.preset, device=device.type, compile="off"), device,
                               max_model_len=4096)
    prompt = torch.randint(0, hf_config["vocab_size"], (128,)).tolist()
    decode_rate(engine, prompt, 8)  # first-call costs

    def rate() -> float:
        return round(sorted(decode_rate(engine, prompt, 64) for _ in range(5))[2], 1)

    record = {"preset": args.preset, "device": device.type, "torch_version": torch.__version__,
              "eager_tok_s_alone": rate(), "eager_tok_s_beside_busy_python": {}}
    stop = threading.Event()

    def busy() -> None:
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i

    threading.Thread(target=busy, daemon=True).start()
    default_interval = sys.getswitchinterval()
    try:
        for interval in INTERVALS_S:
            sys.setswitchinterval(interval)
            record["eager_tok_s_beside_busy_python"][f"{interval * 1e6:g} us"] = rate()
    finally:
        stop.set()
        sys.setswitchinterval(default_interval)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
