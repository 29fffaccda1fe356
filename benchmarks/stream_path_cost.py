"""Event-loop time per streamed token between the engine thread's hand-off and an SSE chunk string, without a
model or sockets: N AsyncEngine handles, one `put_all` per simulated step (as the engine thread schedules it),
each stream read through the HTTP layer's Generation and rendered with `sse_data`, as the completions route does.

    PYTHONPATH=. python3 benchmarks/stream_path_cost.py [--streams 16] [--steps 2000]

The 2-core CI-class machine is too noisy for the end-to-end SSE benchmark on a tiny model; this isolates the
per-token Python cost that competes with the engine thread for the GIL on a GPU host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

from server.api.generation import Choice, Generation
from server.api.metrics import Metrics
from server.api.sse import sse_data
from server.engine.async_engine import AsyncRequestHandle, put_all
from server.engine.types import StreamDelta


async def run(num_streams: int, num_steps: int, keepalive_s: float | None = None) -> float:
    loop = asyncio.get_running_loop()
    owner = SimpleNamespace(queue_abort=lambda request_id: None)
    handles = [AsyncRequestHandle(owner, SimpleNamespace(request_id=f"r{i}", num_prompt_tokens=8), loop)
               for i in range(num_streams)]
    metrics = Metrics(lambda: None)
    done = {"tokens": 0}
    step_drained = asyncio.Event()

    async def consume(handle: AsyncRequestHandle) -> None:
        gen = Generation([Choice(0, 0, handle)], metrics, time.monotonic())
        async for _, delta in gen.events(keepalive_s):
            sse_data({"id": "cmpl-1", "object": "text_completion", "choices": [
                {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}]})
            done["tokens"] += 1
            if done["tokens"] % num_streams == 0:
                step_drained.set()

    consumers = [asyncio.create_task(consume(h)) for h in handles]
    await asyncio.sleep(0)
    start = time.perf_counter()
    for step in range(num_steps):
        finish = "length" if step == num_steps - 1 else None
        step_drained.clear()
        put_all([(h, StreamDelta(h.request_id, " t", [5], finish_reason=finish)) for h in handles])
        await step_drained.wait()
    await asyncio.gather(*consumers)
    return (time.perf_counter() - start) / (num_steps * num_streams) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--keepalive-s", type=float, default=5.0, help="serve's default; 0: no keepalive timer")
    args = parser.parse_args()
    keepalive_s = args.keepalive_s or None
    best = min(asyncio.run(run(args.streams, args.steps, keepalive_s)) for _ in range(args.reps))
    print(json.dumps({"streams": args.streams, "steps": args.steps, "keepalive_s": keepalive_s,
                      "us_per_token": round(best, 2)}))


if __name__ == "__main__":
    main()
