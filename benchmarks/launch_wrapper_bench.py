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


def force_python_wrapper() -> None:
    """Every LaunchCompiled the engine builds has no C++ form: its steps launch from the Python wrapper, the decoder
    layers compiled as regions where torch has them (the engine's form where CUDA graphs replay the step)."""

    class PythonOnly(launch_wrapper.LaunchCompiled):
        def __init__(self, python_fn, name, cpp_fn=None, **kwargs):
            super().__init__(python_fn, name, None, **kwargs)

    decode_graphs.LaunchCompiled = model_runner.LaunchCompiled = PythonOnly


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["python", "cpp"], required=True)
    args, bench_args = parser.parse_known_args()
    if args.wrapper == "python":  # else the engine's own form: the C++ wrapper where no CUDA graph replays the step
        force_python_wrapper()
    sys.exit(main(["bench", *bench_args]))
