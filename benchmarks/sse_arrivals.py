"""When do 16 concurrent SSE requests reach the engine? The arrival spread is the ramp that costs the 16-stream
SSE ratio at short streams (docs/PERF.md, sessions 4-5): the first request starts a step alone while the others
are still being parsed by the HTTP server, which shares the GIL with the engine thread.

    PYTHONPATH=. python3 benchmarks/sse_arrivals.py --preset tiny-moe --device cpu [--streams 16] [--reps 3]

Prints, per repetition, the spread from the first to the last `AsyncEngine.submit` and `Engine.add_request`
(the engine thread admits a submitted request before its next step), and the gaps between submits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import sys
import time

import benchmarks.sse_delivery as sse
from server.engine.async_engine import AsyncEngine


def record_calls(obj, name: str, times: list[float]) -> None:
    """Wrap obj.name so that each call appends its time.perf_counter() to times."""
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        times.append(time.perf_counter())
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--device", default="auto", choices=["auto", "mps", "cuda", "cpu"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    engine_args = sse.parse_args(["--preset", args.preset, "--device", args.device, "--streams", str(args.streams)])
    engine = sse.build_engine(engine_args, args.prompt_len + args.max_tokens + 16)
    engine.warm_up()
    prompts = sse.random_prompts(args.streams, args.prompt_len, engine.vocab_size, 1)
    async_engine = AsyncEngine(engine, max_waiting_requests=4096)
    submits, adds = [], []
    record_calls(async_engine, "submit", submits)
    record_calls(engine, "add_request", adds)
    async_engine.start_thread()
    server, thread, url = sse.start_server(async_engine)
    client = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for rep in range(args.reps):
            submits.clear()
            adds.clear()
            client.submit(sse.sse_client, url, prompts, args.max_tokens).result()
            print(json.dumps({"rep": rep, "device": str(engine.device), "streams": args.streams,
                              "submit_spread_ms": round(1e3 * (submits[-1] - submits[0]), 2),
                              "add_spread_ms": round(1e3 * (adds[-1] - adds[0]), 2),
                              "submit_gaps_ms": [round(1e3 * (b - a), 2) for a, b in itertools.pairwise(submits)]}),
                  flush=True)
    finally:
        client.shutdown()
        server.should_exit = True
        thread.join(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
