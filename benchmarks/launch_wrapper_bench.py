"""`mps-serve bench` with the no-graph decode step and sampler built with inductor's Python wrapper or its C++
wrapper (the engine's form), to measure what the C++ wrapper buys in tok/s and costs in compile seconds. One form
per process: run it twice, each with its own empty TORCHINDUCTOR_CACHE_DIR for cold figures.

    python3 benchmarks/launch_wrapper_bench.py --wrapper python|cpp BENCH-ARGS...
e.g. TORCHINDUCTOR_CACHE_DIR=/tmp/lw-python python3 benchmarks/launch_wrapper_bench.py --wrapper python \\
         --preset qwen3-30b-a3b --batch-sizes 1 --graphs off --json out/lw.jsonl
"""

from __future__ import annotations

import argparse
import sys

from server.cli import main
from server.engine import decode_graphs, launch_wrapper, model_runner


def force_wrapper(cpp: bool) -> None:
    """Every LaunchCompiled the engine builds takes `cpp` for its wrapper, whatever the engine asked."""

    class Forced(launch_wrapper.LaunchCompiled):
        def __init__(self, fn, name, cpp_wrapper, on_fallback=None, **kwargs):
            super().__init__(fn, name, cpp, on_fallback, **kwargs)

    decode_graphs.LaunchCompiled = model_runner.LaunchCompiled = Forced
    if not cpp:  # the Python wrapper calls compiled regions: the layers as the engine traces them with graphs
        original = decode_graphs.compile_layers_as_regions
        decode_graphs.compile_layers_as_regions = lambda model, enabled: original(model, True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["python", "cpp"], required=True)
    args, bench_args = parser.parse_known_args()
    force_wrapper(args.wrapper == "cpp")
    sys.exit(main(["bench", *bench_args]))
