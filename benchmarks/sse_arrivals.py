"""Where do 16 concurrent SSE requests lose time against one Engine.generate call? The ramp that costs the
16-stream SSE ratio at short streams (docs/PERF.md, sessions 4-5).

    PYTHONPATH=. python3 benchmarks/sse_arrivals.py --preset tiny-moe --device cpu [--streams 16] [--reps 3]

Per repetition, one JSON line, times in ms from the first request the client sent (time.perf_counter is one
system-wide monotonic clock, so the client process's times compare with the server's): when the client sent each
request, when `AsyncEngine.submit` and `Engine.add_request` saw it, and the engine's steps (start, duration,
sequences and tokens scheduled) over the first `--steps`, then the number of steps and the end. A first line does
the same for `Engine.generate` of the same prompts in one call: the reference the SSE ratio is taken against.
On CUDA each line also carries the device's own time per launch and its idle time before it (`device_spans`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import multiprocessing
import sys
import time

import benchmarks.sse_delivery as sse
from server.cli import freeze_startup_objects
from server.engine.async_engine import AsyncEngine
from server.engine.types import SamplingParams


def record_calls(obj, name: str, times: list) -> None:
    """Wrap obj.name so that each call appends (start, end, result) in time.perf_counter() seconds."""
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        times.append((start, time.perf_counter(), result))
        return result

    setattr(obj, name, wrapped)


class DeviceSpans:
    """CUDA events recorded on the current stream just before and after each launch: per step, how long the
    device spent on what the launch queued (`gpu_ms`) and the time from the previous launch's end to this one's
    start (`idle_ms`: the device idle because the host queued the step late, or running work queued outside
    launches). Tells a device that ran slower from a host that fell behind. Nothing is recorded off CUDA."""

    def __init__(self, runner, device):
        import torch

        self.torch, self.enabled, self.events = torch, device.type == "cuda", []  # (perf_counter, before, after)
        original = runner.launch

        def launch(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start, (before, after) = time.perf_counter(), (torch.cuda.Event(enable_timing=True) for _ in range(2))
            before.record()
            result = original(*args, **kwargs)
            after.record()
            self.events.append((start, before, after))
            return result

        runner.launch = launch

    def summary(self, origin: float, num_shown: int) -> dict:
        """gpu_ms / idle_ms of the first num_shown and the last 10 launches after origin, and their totals."""
        events = [(before, after) for start, before, after in self.events if start >= origin]
        if not events:
            return {}
        self.torch.cuda.synchronize()
        gpu = [before.elapsed_time(after) for before, after in events]
        idle = [0.0] + [max(0.0, prev_after.elapsed_time(before)) for (_, prev_after), (before, _) in zip(events, events[1:], strict=False)]
        shown = list(range(min(num_shown, len(events)))) + list(range(max(num_shown, len(events) - 10), len(events)))
        return {"device_spans": [[i, round(gpu[i], 2), round(idle[i], 2)] for i in shown],  # [launch, gpu ms, idle ms]
                "device_gpu_ms": round(sum(gpu), 2), "device_idle_ms": round(sum(idle), 2),
                "device_idle_max_ms": round(max(idle), 2)}


async def _timed_streams(url: str, prompts: list[list[int]], max_tokens: int, open_first: bool) -> dict:
    import httpx

    sent, first = [], []

    async def one(client, prompt, max_tokens=max_tokens):
        body = {"model": sse.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        sent.append(time.perf_counter())
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            seen_first = False
            async for line in response.aiter_lines():
                if not seen_first and line.startswith("data: "):
                    first.append(time.perf_counter())  # order-free: shown sorted
                    seen_first = True
        return time.perf_counter()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        if open_first:  # one-token requests first, so the timed ones reuse open connections (as a pooled client)
            await asyncio.gather(*(one(client, p, 1) for p in prompts))
            sent.clear()
            first.clear()
        ends = await asyncio.gather(*(one(client, p) for p in prompts))
    return {"sent": sent, "first_chunk": first, "end": max(ends)}


def timed_streams(url: str, prompts: list[list[int]], max_tokens: int, open_first: bool = False) -> dict:
    """In the client process: absolute perf_counter times of each send, each first chunk and the last end."""
    return asyncio.run(_timed_streams(url, prompts, max_tokens, open_first))


def timeline(origin: float, steps: list, schedules: list, launches: list, end: float, num_shown: int) -> dict:
    """Steps as [start ms, duration ms, sequences, tokens, launch ms] from origin, the first num_shown of them,
    and the five slowest of all with their index in front (each step schedules once; its launch is the host's
    share, the rest mostly waits for the previous step)."""
    rows = []
    for (start, stop, _), (_, _, out) in zip(steps, schedules, strict=False):
        launch = sum(e - s for s, e, _ in launches if start <= s <= stop)
        rows.append([round(1e3 * (start - origin), 2), round(1e3 * (stop - start), 2), len(out.chunks), out.num_tokens,
                     round(1e3 * launch, 2)])
    slowest = sorted(range(len(rows)), key=lambda i: rows[i][1], reverse=True)[:5]
    return {"steps": rows[:num_shown], "slowest_steps": [[i, *rows[i]] for i in sorted(slowest)],
            "num_steps": len(steps), "end_ms": round(1e3 * (end - origin), 2)}


class ProcessEvents:
    """What else ran in the server process during a repetition: garbage collections (a full one walks every
    object the compiled graphs keep), dynamo compiles, and device memory allocations by the caching allocator."""

    def __init__(self, device):
        import torch

        self.torch, self.device, self.pauses, self._start = torch, device, [], 0.0
        gc.callbacks.append(self._on_gc)
        self.reset()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def _counts(self) -> dict:
        from torch._dynamo.utils import counters

        counts = {"graphs": counters["stats"]["unique_graphs"]}
        if self.device.type == "cuda":
            stats = self.torch.cuda.memory_stats(self.device)
            counts.update(device_mallocs=stats.get("segment.all.allocated", 0),
                          alloc_retries=stats.get("num_alloc_retries", 0))
        return counts

    def reset(self) -> None:
        self.pauses.clear()
        self._base = self._counts()

    def summary(self) -> dict:
        full = [p for g, p in self.pauses if g == 2]
        now = self._counts()
        return {"gc_collections": len(self.pauses), "gc_full": len(full), "gc_full_ms": round(1e3 * sum(full), 2),
                "gc_max_ms": round(1e3 * max((p for _, p in self.pauses), default=0.0), 2),
                **{f"new_{k}": now[k] - self._base[k] for k in now}}


def ms_after(origin: float, times: list[float]) -> list[float]:
    return [round(1e3 * (t - origin), 2) for t in times]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--device", default="auto", choices=["auto", "mps", "cuda", "cpu"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps shown per repetition")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--open-connections", action="store_true",
                        help="the client opens its 16 connections (one-token requests) before each timed run")
    parser.add_argument("--main-thread", action="store_true",
                        help="warm up and run the reference on the main thread (not the engine thread)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave start-up objects to the cyclic GC (serve freezes them after its warm-up)")
    return parser.parse_args(argv)


class Recorder:
    """The engine's calls, timed: steps, their schedules and launches, submits and admissions."""

    def __init__(self, engine, async_engine):
        self.steps, self.schedules, self.launches, self.submits, self.adds = [], [], [], [], []
        record_calls(engine, "step", self.steps)
        record_calls(engine.scheduler, "schedule", self.schedules)
        record_calls(engine.runner, "launch", self.launches)
        self.device = DeviceSpans(engine.runner, engine.device)
        record_calls(async_engine, "submit", self.submits)
        record_calls(engine, "add_request", self.adds)
        self.events = ProcessEvents(engine.device)

    def reset(self) -> None:
        for log in (self.steps, self.schedules, self.launches, self.submits, self.adds, self.device.events):
            log.clear()
        self.events.reset()

    def drop_before(self, origin: float) -> None:
        """Forget what came before origin (the connection-opening requests); schedules pair with steps."""
        for log in (self.submits, self.adds, self.launches):
            log[:] = [record for record in log if record[0] >= origin]
        kept = [i for i, record in enumerate(self.steps) if record[0] >= origin]
        self.steps[:], self.schedules[:] = [self.steps[i] for i in kept], [self.schedules[i] for i in kept]

    def summary(self, origin: float, end: float, num_shown: int) -> dict:
        return {**timeline(origin, self.steps, self.schedules, self.launches, end, num_shown), **self.events.summary(),
                **self.device.summary(origin, num_shown)}


def sse_record(rep: int, times: dict, recorder: Recorder, args: argparse.Namespace) -> dict:
    origin = min(times["sent"])
    recorder.drop_before(origin)
    return {"run": "sse", "rep": rep, "streams": args.streams, "sent_ms": ms_after(origin, times["sent"]),
            "submit_ms": ms_after(origin, [s for s, _, _ in recorder.submits]),
            "add_ms": ms_after(origin, [s for s, _, _ in recorder.adds]),
            "first_chunk_ms": ms_after(origin, sorted(times["first_chunk"])),
            "gc_frozen_objects": gc.get_freeze_count(), "open_connections": args.open_connections,
            **recorder.summary(origin, times["end"], args.steps)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = [arg for option in args.engine_option for arg in ("--engine-option", option)]
    engine_args = sse.parse_args(["--preset", args.preset, "--device", args.device, "--streams", str(args.streams),
                                  *options])
    engine = sse.build_engine(engine_args, args.prompt_len + args.max_tokens + 16)
    async_engine = AsyncEngine(engine, max_waiting_requests=4096)
    # every stream measured runs compiled: the warm-up runs first, on the engine thread (--main-thread: it and the
    # reference on the main thread, the A/B for per-thread device state)
    on_thread = (lambda function: function()) if args.main_thread else async_engine.call
    on_thread(engine.warm_up)
    if not args.no_gc_freeze:
        freeze_startup_objects()
    prompts = sse.random_prompts(args.streams, args.prompt_len, engine.vocab_size, 1)
    recorder = Recorder(engine, async_engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def reference() -> tuple[float, float]:
        recorder.reset()
        start = time.perf_counter()
        engine.generate(prompts, params)
        return start, time.perf_counter()

    on_thread(reference)  # the second is timed: the first compiles what the warm-up did not
    start, end = on_thread(reference)
    print(json.dumps({"run": "engine.generate", "device": str(engine.device), "streams": args.streams,
                      "main_thread": args.main_thread, **recorder.summary(start, end, args.steps)}), flush=True)
    async_engine.start_thread()
    server, thread, url = sse.start_server(async_engine)
    client = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for rep in range(args.reps):
            recorder.reset()
            times = client.submit(timed_streams, url, prompts, args.max_tokens, args.open_connections).result()
            print(json.dumps({**sse_record(rep, times, recorder, args), "device": str(engine.device)}), flush=True)
    finally:
        client.shutdown()
        server.should_exit = True
        thread.join(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
