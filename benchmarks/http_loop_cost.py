"""Event-loop CPU per streamed request in the real server: uvicorn's HTTP implementations side by side.

Every streamed chunk is parsed, framed and written on the event loop, which shares the GIL with the engine
thread; the loop's CPU per request is what competes with the engine's steps at 16 streams.

    PYTHONPATH=. python3 benchmarks/http_loop_cost.py [--max-tokens 64] [--concurrency 16] [--requests 128]

A tiny random model on the CPU (eager) answers `/v1/completions` streams from a client in its own process; the
server's event loop runs in this process's main thread, and `time.thread_time()` of that thread over the timed
requests, divided by their number, is the figure (the engine thread's CPU is not in it). Each HTTP
implementation is measured `--rounds` times, alternating; the first round also pays first-use costs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import time

import benchmarks.sse_delivery as sse
from server.cli import freeze_startup_objects
from server.engine.async_engine import AsyncEngine


def client(url: str, num_requests: int, max_tokens: int, concurrency: int) -> None:
    import httpx

    body = {"model": sse.SERVED_NAME, "prompt": list(range(1, 129)), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}

    async def one(http_client) -> None:
        async with http_client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http_client:
            for _ in range(num_requests // concurrency):
                await asyncio.gather(*(one(http_client) for _ in range(concurrency)))

    asyncio.run(run())


def measure(http: str, async_engine, pool, args) -> dict:
    import uvicorn

    from server.api.app import create_app
    from server.config import ServerConfig

    app = create_app(async_engine, ServerConfig(served_model_name=sse.SERVED_NAME, max_waiting_requests=4096))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                           http=http, loop="asyncio"))
    result = {"http": http}

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        warm = (url, args.concurrency, args.max_tokens, args.concurrency)
        await loop.run_in_executor(None, lambda: pool.submit(client, *warm).result())
        cpu, wall = time.thread_time(), time.perf_counter()
        timed = (url, args.requests, args.max_tokens, args.concurrency)
        await loop.run_in_executor(None, lambda: pool.submit(client, *timed).result())
        result.update(loop_cpu_ms_per_request=round(1e3 * (time.thread_time() - cpu) / args.requests, 3),
                      wall_s=round(time.perf_counter() - wall, 3))
        server.should_exit = True
        await task

    asyncio.run(main())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--http", default="h11,httptools")
    args = parser.parse_args()
    engine_args = sse.parse_args(["--preset", "tiny-moe", "--device", "cpu", "--streams", str(args.concurrency),
                                  "--engine-option", "compile=off"])
    async_engine = AsyncEngine(sse.build_engine(engine_args, 256), max_waiting_requests=4096)
    async_engine.warm_up()
    freeze_startup_objects()  # as serve does after its warm-up
    async_engine.start_thread()
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for round_index in range(args.rounds):
            for http in args.http.split(","):
                print(json.dumps({"round": round_index, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                                  **measure(http, async_engine, pool, args)}), flush=True)
    finally:
        pool.shutdown()  # the engine thread is a daemon: it ends with the process


if __name__ == "__main__":
    main()
