"""Does streaming keep up? Tokens/s delivered over SSE by a real uvicorn server vs the engine's own tokens/s.

For each number of concurrent streams N (default 1 and 16), with the same N random token-id prompts, greedy,
ignore_eos, `--max-tokens` new tokens each, best of `--reps`:
  engine  Engine.generate(N prompts) in this process:            N * max_tokens / wall time
  async   AsyncEngine.stream() x N on one event loop (no HTTP):   same count / wall time
  sse     N concurrent POST /v1/completions, stream=true, through create_app + uvicorn on 127.0.0.1, read
          with httpx: sum of usage.completion_tokens / (last [DONE] - first request sent); with
          `--endpoint ollama`, POST /api/generate (raw, NDJSON) instead: sum of the final lines' eval_count
          / (last final line - first request sent), the prompts then sent as text (the engine gets that text too)
All three include prefill, so the ratios compare like with like; target: sse >= 98% of engine (issue 5).
The steady rates run engine and SSE again at max_tokens/2 and take N * (max_tokens/2) / (t_long - t_short):
what is left is the delivery rate while streaming, without the fixed costs (connections, prefill, the ramp
while concurrent requests arrive over the first steps). The streamed text is checked against the engine's.

    PYTHONPATH=. python3 benchmarks/sse_delivery.py --preset tiny-moe --device cpu --streams 1,4 --max-tokens 32
    PYTHONPATH=. python3 benchmarks/sse_delivery.py --preset llama-3.1-8b --streams 1,16 --json sse.jsonl
    PYTHONPATH=. python3 benchmarks/sse_delivery.py demo --device cpu --streams 1,16 --endpoint ollama

A preset gets random weights and a synthetic word-level tokenizer over its whole vocabulary (token i is the
word `t{i}`), so text flows through the detokenizer and the SSE framing as for a real model. Needs the server's
dependencies (fastapi, uvicorn, pydantic, prometheus_client) and httpx besides the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from server.bench.measure import synchronize
from server.bench.options import engine_option
from server.bench.presets import load_preset
from server.bench.run import device_name, random_prompts
from server.cli import freeze_startup_objects
from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.types import SamplingParams

SERVED_NAME = "sse-bench"


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json where id i is the word `t{i}` (decoded text: words joined by spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def build_engine(args: argparse.Namespace, max_len: int):
    from server.engine.engine import Engine

    max_seqs = max(args.streams)
    if args.model:
        config = EngineConfig.from_flat(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max_seqs,
                                        max_model_len=max_len, enable_prefix_caching=False, **args.engine_options)
        return Engine.from_config(config)
    from server.bench.random_model import build_random_model
    from server.engine.tokenizer import Tokenizer

    hf_config = load_preset(args.preset).hf_config
    device, _ = device_mod.select_device(args.device)
    dtype = device_mod.select_dtype(args.dtype, device, hf_config.get("torch_dtype"))
    model = build_random_model(hf_config, device, dtype, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        write_word_tokenizer(Path(tmp), int(hf_config["vocab_size"]))
        tokenizer = Tokenizer.from_pretrained(tmp)
    config = EngineConfig.from_flat(model=args.preset, device=device.type, dtype=str(dtype).removeprefix("torch."),
                                    max_num_seqs=max_seqs, max_model_len=max_len, enable_prefix_caching=False,
                                    **args.engine_options)
    return Engine.from_model(model, config, device, tokenizer=tokenizer, max_model_len=max_len)


def engine_seconds(engine, prompts: list[list[int]], max_tokens: int, reps: int) -> tuple[float, list[str]]:
    """Best wall time of Engine.generate(prompts) for max_tokens new tokens each, and the texts."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up: compile / graphs for this batch size
    best, texts = float("inf"), []
    for _ in range(reps):
        synchronize(engine.device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
        texts = [o.text for o in outs]
    return best, texts


def steady_rate(num_streams: int, lengths: tuple[int, int], seconds: tuple[float, float]) -> float:
    """Tokens/s between the short and the long run: prefill, connection set-up and the ramp cancel out."""
    return num_streams * (lengths[1] - lengths[0]) / max(seconds[1] - seconds[0], 1e-9)


async def _async_once(async_engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        return sum([len(d.token_ids) async for d in async_engine.stream(prompt, params)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


def async_rate(async_engine, prompts: list[list[int]], max_tokens: int, reps: int) -> float:
    async_engine.start_thread()
    asyncio.run(_async_once(async_engine, prompts, max_tokens))  # warm-up: staggered arrivals hit new buckets
    return max(asyncio.run(_async_once(async_engine, prompts, max_tokens)) for _ in range(reps))


async def _ollama_one(client, url: str, prompt: str, max_tokens: int, start: float) -> dict:
    """One /api/generate stream: raw prompt, greedy, `ignore_eos` (mps-serve's extension of Ollama's options)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "raw": True, "stream": True,
            "options": {"temperature": 0, "num_predict": max_tokens, "ignore_eos": True}}
    text, arrivals, tokens = [], [], None
    async with client.stream("POST", f"{url}/api/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            chunk = json.loads(line)
            if "error" in chunk:
                raise RuntimeError(f"the server streamed an error: {chunk['error']}")
            if chunk["response"]:
                text.append(chunk["response"])
                arrivals.append(time.perf_counter() - start)
            if chunk["done"]:
                tokens = chunk["eval_count"]
    if tokens is None:
        raise RuntimeError("the stream ended without its final line")
    return _stream_record(text, arrivals, tokens, start)


def _stream_record(text: list[str], arrivals: list[float], tokens: int, start: float) -> dict:
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"text": "".join(text), "tokens": tokens, "ttft": arrivals[0] if arrivals else None,
            "mean_gap": sum(gaps) / len(gaps) if gaps else None, "chunks": len(arrivals),
            "end": time.perf_counter() - start}


async def _stream_one(client, url: str, prompt: list[int] | str, max_tokens: int, start: float,
                      endpoint: str = "completions") -> dict:
    if endpoint == "ollama":
        return await _ollama_one(client, url, prompt, max_tokens, start)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, arrivals, usage, done = [], [], None, False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"the server streamed an error: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                text.append(chunk["choices"][0]["text"])
                arrivals.append(time.perf_counter() - start)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not done or usage is None:
        raise RuntimeError("the stream ended without a usage chunk and [DONE]")
    return _stream_record(text, arrivals, usage["completion_tokens"], start)


async def _sse_once(url: str, prompts: list, max_tokens: int, open_first: bool,
                    start_at: float | None, endpoint: str) -> tuple[float, list[dict]]:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        if open_first:  # one-token requests open the connections first, as a long-lived client's pool has them
            await asyncio.gather(*(_stream_one(client, url, p, 1, time.perf_counter(), endpoint) for p in prompts))
        late_s = 0.0
        if start_at is not None:  # perf_counter is one system-wide monotonic clock: every process starts together
            await asyncio.sleep(max(0.0, start_at - time.perf_counter() - 0.002))
            while time.perf_counter() < start_at:  # the loop's timers are ms-coarse: spin the last 2 ms
                pass
            late_s = time.perf_counter() - start_at  # counted in the time: a late process only makes SSE look slower
        start = time.perf_counter() if start_at is None else start_at
        streams = await asyncio.gather(*(_stream_one(client, url, p, max_tokens, start, endpoint) for p in prompts))
    elapsed = max(s["end"] for s in streams)
    return elapsed, [{**s, "client_late_ms": 1e3 * late_s} for s in streams]


def sse_client(url: str, prompts: list, max_tokens: int, open_first: bool = False,
               start_at: float | None = None, endpoint: str = "completions") -> tuple[float, list[dict]]:
    """(seconds from the first request sent, or from `start_at`, to the last [DONE]; per-stream details).
    open_first: the timed requests reuse connections already open (else each opens its own, inside the timed
    span)."""
    return asyncio.run(_sse_once(url, prompts, max_tokens, open_first, start_at, endpoint))


def _http_implementation() -> str:
    """What uvicorn's http="auto" runs on: httptools when importable, else the pure-Python h11."""
    import importlib.util

    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def _client_ready() -> None:
    """A client process's initializer: this module (named by it) and httpx are imported before any timed run."""
    import httpx  # noqa: F401


def sse_clients(pool, num_processes: int, url: str, prompts: list, max_tokens: int,
                open_first: bool, endpoint: str) -> tuple[float, list[dict]]:
    """The prompts dealt over `num_processes` client processes that send at one common instant, as independent
    users would: one asyncio client sends its requests one after another (~0.5 ms of client CPU each)."""
    if num_processes == 1:
        return pool.submit(sse_client, url, prompts, max_tokens, open_first, None, endpoint).result()
    start_at = time.perf_counter() + 2.0  # time for every process to open its connections first
    parts = [pool.submit(sse_client, url, prompts[i::num_processes], max_tokens, open_first, start_at, endpoint)
             for i in range(num_processes)]
    results = [part.result() for part in parts]
    streams = [None] * len(prompts)
    for i, (_, part_streams) in enumerate(results):
        streams[i::num_processes] = part_streams
    return max(elapsed for elapsed, _ in results), streams


def start_server(async_engine):
    import uvicorn

    from server.api.app import create_app
    from server.config import ServerConfig

    app = create_app(async_engine, ServerConfig(served_model_name=SERVED_NAME, max_waiting_requests=4096))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def run(args: argparse.Namespace) -> list[dict]:
    from server.engine.async_engine import AsyncEngine

    # Ollama's prompts are the random ids as text, which can encode to more tokens than the ids: room for them
    prompt_room = 4 * args.prompt_len if args.endpoint == "ollama" else args.prompt_len
    max_len = prompt_room + args.max_tokens + 16
    engine = build_engine(args, max_len)
    # Everything runs on the engine thread, as in `serve` (warm-up before /health turns ready), and what start-up
    # left alive is frozen for the GC, as serve does.
    async_engine = AsyncEngine(engine, max_waiting_requests=4096)
    async_engine.warm_up()
    freeze_startup_objects()
    batches = {n: random_prompts(n, args.prompt_len, engine.vocab_size, args.seed + n) for n in args.streams}
    if args.endpoint == "ollama":  # Ollama's prompt is text: the engine is measured on the same text
        batches = {n: [engine.tokenizer.decode(p) for p in prompts] for n, prompts in batches.items()}
    results = {n: {"streams": n} for n in args.streams}
    lengths = (args.max_tokens // 2, args.max_tokens)
    texts, engine_s = {}, {}
    for n, prompts in batches.items():
        short_s, _ = async_engine.call(lambda p=prompts: engine_seconds(engine, p, lengths[0], args.reps))
        long_s, texts[n] = async_engine.call(lambda p=prompts: engine_seconds(engine, p, lengths[1], args.reps))
        engine_s[n] = (short_s, long_s)
        results[n]["engine_tok_s"] = n * lengths[1] / long_s
        results[n]["engine_steady_tok_s"] = steady_rate(n, lengths, engine_s[n])
        print(f"engine N={n}: {results[n]['engine_tok_s']:.1f} tok/s", file=sys.stderr)
    for n, prompts in batches.items():
        results[n]["async_tok_s"] = async_rate(async_engine, prompts, args.max_tokens, args.reps)
    server, thread, url = start_server(async_engine)
    # The client runs in its own process: in this one it would share the GIL with the server and the engine
    # and be counted as server cost.
    num_processes = max(args.client_processes, 1)
    client = concurrent.futures.ProcessPoolExecutor(num_processes, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_client_ready)
    list(client.map(time.sleep, [0.5] * num_processes))  # start (and import) every client process before timing

    def best_sse(prompts: list[list[int]], num_new: int) -> tuple[float, list[dict]]:
        # warm-up: connections, staggered buckets
        client.submit(sse_client, url, prompts, num_new, False, None, args.endpoint).result()
        runs = (sse_clients(client, min(num_processes, len(prompts)), url, prompts, num_new, args.open_connections,
                            args.endpoint) for _ in range(args.reps))
        return min(runs, key=lambda r: r[0])

    try:
        for n, prompts in batches.items():
            short_s, _ = best_sse(prompts, lengths[0])
            long_s, streams = best_sse(prompts, lengths[1])
            results[n].update(summarize(long_s, streams, texts[n], results[n], args.max_tokens))
            results[n]["sse_steady_tok_s"] = steady_rate(n, lengths, (short_s, long_s))
            results[n]["sse_steady_vs_engine"] = results[n]["sse_steady_tok_s"] / results[n]["engine_steady_tok_s"]
            print(f"{args.endpoint} N={n}: {results[n]['sse_tok_s']:.1f} tok/s ({results[n]['sse_vs_engine']:.1%} of the engine; "
                  f"steady {results[n]['sse_steady_vs_engine']:.1%})", file=sys.stderr)
    finally:
        client.shutdown()
        server.should_exit = True
        thread.join(timeout=60)
    common = {"preset": args.preset, "model": args.model, "device": str(engine.device), "endpoint": args.endpoint,
              "engine_options": args.engine_options, "open_connections": args.open_connections,
              "client_processes": args.client_processes, "http": _http_implementation(),
              "gpu_name": device_name(engine.device),
              "dtype": str(engine.dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "torch_version": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    return [{**common, **results[n]} for n in args.streams]


def summarize(sse_seconds: float, streams: list[dict], engine_texts: list[str], result: dict, max_tokens: int) -> dict:
    gaps = [s["mean_gap"] for s in streams if s["mean_gap"] is not None]
    sse_tok_s = sum(s["tokens"] for s in streams) / sse_seconds
    return {
        "sse_tok_s": sse_tok_s,
        "sse_vs_engine": sse_tok_s / result["engine_tok_s"],
        "async_vs_engine": result["async_tok_s"] / result["engine_tok_s"],
        "mean_ttft_s": sum(s["ttft"] for s in streams) / len(streams),
        "mean_inter_chunk_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
        "chunks_per_stream": sum(s["chunks"] for s in streams) / len(streams),
        "client_late_ms": max(s["client_late_ms"] for s in streams),  # > 0: a client process missed the start
        "all_tokens_delivered": all(s["tokens"] == max_tokens for s in streams),
        "text_matches_engine": [s["text"] for s in streams] == engine_texts,
        # bf16 greedy can diverge when the batch differs (streams arrive staggered): a late first divergence
        # is numerics; one at word 0, or a stream carrying another prompt's text, would be a mix-up.
        "streams_matching_engine": sum(s["text"] == t for s, t in zip(streams, engine_texts, strict=True)),
        "first_divergent_word": min((_first_difference(s["text"].split(), t.split())
                                     for s, t in zip(streams, engine_texts, strict=True) if s["text"] != t),
                                    default=None),
    }


def _first_difference(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def print_table(records: list[dict]) -> None:
    print(f"{'N':>3} {'engine tok/s':>13} {'async tok/s':>12} {'sse tok/s':>10} {'sse/engine':>11} "
          f"{'steady sse/engine':>18} {'ttft ms':>8} {'gap ms':>7}  text")
    for r in records:
        gap = "-" if r["mean_inter_chunk_ms"] is None else f"{r['mean_inter_chunk_ms']:.2f}"
        print(f"{r['streams']:>3} {r['engine_tok_s']:>13.1f} {r['async_tok_s']:>12.1f} {r['sse_tok_s']:>10.1f} "
              f"{r['sse_vs_engine']:>10.1%} {r['sse_steady_vs_engine']:>17.1%} {r['mean_ttft_s'] * 1e3:>8.1f} {gap:>7}  "
              f"{'same as engine' if r['text_matches_engine'] else 'DIFFERS from engine'}"
              + ("" if r["text_matches_engine"] else f" ({r['streams_matching_engine']}/{r['streams']} streams equal; "
                 f"first difference at word {r['first_divergent_word']})"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint directory or Hub repo id")
    parser.add_argument("--preset", default=None, help="server/configs/presets/NAME.toml (random weights)")
    parser.add_argument("--device", default="auto", choices=["auto", "mps", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--streams", default="1,16", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--open-connections", action="store_true",
                        help="open the client's connections before each timed run (a pooled client, e.g. the openai "
                             "SDK's); by default each timed request opens its own")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="deal the streams over this many client processes that send at one instant (16: one "
                             "per stream, like independent users); 1: one asyncio client sends them in turn")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "ollama"],
                        help="stream /v1/completions (SSE) or Ollama's /api/generate (NDJSON)")
    parser.add_argument("--json", default=None, help="append one JSON object per N")
    parser.add_argument("--engine-option", action="append", type=engine_option, default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field, e.g. compile_prefill=true (repeatable)")
    args = parser.parse_args(argv)
    args.engine_options = dict(args.engine_option)
    if (args.model is None) == (args.preset is None):
        parser.error("give a MODEL or --preset NAME (not both)")
    args.streams = [int(v) for v in args.streams.split(",") if v.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records = run(args)
    print_table(records)
    if args.json:
        with open(args.json, "a") as handle:
            handle.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
