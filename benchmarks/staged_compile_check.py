"""Greedy tokens served while the background compile runs its stages, against an eager engine, on any device
(on CUDA this exercises graph captures beside replays of the graphs already captured). Random weights.

    PYTHONPATH=. python3 benchmarks/staged_compile_check.py --preset tiny-moe

Prints one JSON line: how many single-sequence and two-sequence generations were compared in each compile state,
how many differed, and the stage timings the background compile logged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's (the sampler's width)")
    parser.add_argument("--dtype", default="auto",
                        help="float32 makes greedy identity exact: in bf16, near-ties among a wide vocabulary's logits "
                             "let the compiled and eager roundings pick different tokens")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="stop comparing after this long")
    args = parser.parse_args(argv)

    import torch

    from server.bench.presets import load_preset
    from server.bench.random_model import build_random_model
    from server.config import EngineConfig
    from server.engine import device as device_mod
    from server.engine.engine import Engine
    from server.engine.types import SamplingParams

    hf_config = load_preset(args.preset).hf_config
    if args.vocab_size is not None:
        hf_config = {**hf_config, "vocab_size": args.vocab_size}
    device, _ = device_mod.select_device("auto")
    dtype = device_mod.select_dtype(args.dtype, device, hf_config.get("torch_dtype"))
    model = build_random_model(hf_config, device, dtype, 0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf_config["vocab_size"], (n,), generator=generator).tolist() for n in (9, 23)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def engine(compile_mode: str) -> Engine:
        config = EngineConfig.from_flat(model=args.preset, device=device.type, compile=compile_mode, max_num_seqs=4)
        return Engine.from_model(model, config, device, max_model_len=256)

    eager = engine("off")
    expected = {n: [o.token_ids for o in eager.generate(prompts[:n], params)] for n in (1, 2)}
    del eager
    compiled = engine("on")
    background = compiled.compile_in_background()
    counts: dict[str, dict[str, int]] = {}
    start = time.perf_counter()
    while True:
        done = background.join(0)
        state = compiled.compile_state
        if state == "compiling" and background.first_stage_ready:
            state += ", one sequence compiled"
        for n in (1, 2):
            got = [o.token_ids for o in compiled.generate(prompts[:n], params)]
            if f"{state}, batch {n}" not in counts:
                print(f"{time.perf_counter() - start:.1f} s: {state}, batch {n}", flush=True)
            tally = counts.setdefault(f"{state}, batch {n}", {"runs": 0, "differ": 0})
            tally["runs"] += 1
            tally["differ"] += got != expected[n]
        if done or time.perf_counter() - start > args.timeout_s:
            break
    record = {"preset": args.preset, "device": device.type, "torch_version": torch.__version__,
              "compile_state": compiled.compile_state, "error": background.error,
              "compile_s": background.seconds, "compared": counts,
              "all_equal": all(t["differ"] == 0 for t in counts.values())}
    print(json.dumps(record), flush=True)
    return 0 if record["all_equal"] and compiled.compile_state == "ready" else 1


if __name__ == "__main__":
    sys.exit(main())
