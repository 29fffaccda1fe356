"""Soak: many concurrent clients, careless and hostile ones among them, against `mps-serve serve` on the demo model.

    PYTHONPATH=. python3 benchmarks/soak.py [--requests 1000] [--concurrency 32] [--seed 0] [--json FILE]

The server runs in a child process (its RSS is its own). Requests mix chat and text completions, streamed and
not, n > 1 and tools, all greedy; a share of clients hang up before, during or after sending the request (mid
generation, mid stream); some prompts are longer than the context and some bodies are invalid. It checks:
- every answer is what it should be: completed greedy text equals the same request run alone (after the soak,
  one at a time), refusals are 4xx in OpenAI's error shape, nothing is a 5xx;
- afterwards the server holds no request: 0 running, 0 waiting, 0 KV blocks in use (/metrics);
- the server's RSS after the last hundred requests is within 5% of its RSS after the second hundred.
Prints one JSON summary; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_TOKENS = 12
WORDS = "the small model wakes up on a fresh machine and writes its own weights before it answers".split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
INVALID_BODIES = [
    b"{not json", b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
    b'{"name": "f", "parameters": {"properties": 3}}}], "stream": true}',
]
# kind -> weight; the greedy kinds are checked against solo runs
KINDS = {"chat": 4, "chat_stream": 4, "chat_n": 2, "chat_tools": 2, "completion": 2, "completion_stream": 2,
         "overlong": 1, "invalid": 1}
DISCONNECTS = ("before", "during", "after")


@dataclass
class Plan:
    kind: str
    prompt_index: int
    disconnect: str | None  # where the client hangs up, if it does
    delay_s: float  # how long into the request, for "after"


@dataclass
class Results:
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    texts: list[tuple[tuple, str]] = field(default_factory=list)  # (solo key, text) of completed greedy requests
    rss_mb: list[float] = field(default_factory=list)  # the server's, after every `rss_every` requests
    num_done: int = 0


def make_plans(num_requests: int, num_prompts: int, disconnect_share: float, rng: random.Random) -> list[Plan]:
    kinds = [k for k, w in KINDS.items() for _ in range(w)]
    plans = []
    for _ in range(num_requests):
        disconnect = rng.choice(DISCONNECTS) if rng.random() < disconnect_share else None
        plans.append(Plan(rng.choice(kinds), rng.randrange(num_prompts), disconnect, rng.uniform(0.0, 0.3)))
    return plans


def prompt_text(index: int) -> str:
    rng = random.Random(index)
    return " ".join(rng.choice(WORDS) for _ in range(8 + index % 7))


def request_of(plan: Plan) -> tuple[str, dict[str, Any] | bytes, tuple | None]:
    """(path, body, solo key): the key names the solo run a completed greedy answer must equal."""
    text, kind = prompt_text(plan.prompt_index), plan.kind
    if kind == "invalid":
        return "/v1/chat/completions", INVALID_BODIES[plan.prompt_index % len(INVALID_BODIES)], None
    if kind == "overlong":
        return "/v1/completions", {"prompt": "tok " * 5000, "max_tokens": MAX_TOKENS}, None
    if kind.startswith("completion"):
        body = {"prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": kind.endswith("stream")}
        return "/v1/completions", body, ("completion", plan.prompt_index)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": kind == "chat_stream", "n": 2 if kind == "chat_n" else 1}
    if kind == "chat_tools":
        body["tools"] = TOOLS
    return "/v1/chat/completions", body, ("chat", plan.prompt_index, kind == "chat_tools")


def answer_texts(path: str, body: dict, response: httpx.Response) -> list[str]:
    if body.get("stream"):
        events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        if events[-1] != "[DONE]":
            raise AssertionError(f"stream without [DONE]: {events[-1][:200]}")
        chunks = [json.loads(e) for e in events[:-1]]
        field_name = "text" if path == "/v1/completions" else "content"
        pieces: dict[int, list[str]] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                piece = choice["text"] if field_name == "text" else choice["delta"].get("content") or ""
                pieces.setdefault(choice["index"], []).append(piece)
        return ["".join(p) for _, p in sorted(pieces.items())]
    answer = response.json()
    if path == "/v1/completions":
        return [c["text"] for c in answer["choices"]]
    messages = [c["message"] for c in answer["choices"]]
    return [(m["content"] or "") + (json.dumps(m["tool_calls"]) if m.get("tool_calls") else "") for m in messages]


def check_error(response: httpx.Response, expected_code: str | None = None) -> str | None:
    """None when `response` is a proper refusal: a 4xx with an OpenAI error body."""
    if not 400 <= response.status_code < 500:
        return f"status {response.status_code}: {response.text[:200]}"
    error = response.json().get("error", {})
    if set(error) != {"message", "type", "param", "code"}:
        return f"error body not OpenAI-shaped: {response.text[:200]}"
    if expected_code is not None and error["code"] != expected_code:
        return f"expected {expected_code}, got {error}"
    return None


async def hang_up_early(url: str, path: str, raw: bytes, where: str, rng: random.Random) -> None:
    """A client that leaves before its request is whole: during the head ("before") or the body ("during")."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    sent = head[: rng.randrange(len(head))] if where == "before" else head + raw[: rng.randrange(max(1, len(raw)))]
    writer.write(sent)
    await writer.drain()
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    writer.close()
    await writer.wait_closed()


async def run_one(client: httpx.AsyncClient, url: str, plan: Plan, results: Results, rng: random.Random) -> None:
    path, body, solo_key = request_of(plan)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if plan.disconnect in ("before", "during"):
        await hang_up_early(url, path, raw, plan.disconnect, rng)
        results.outcomes[f"hung up {plan.disconnect} the upload"] += 1
        return
    streamed = isinstance(body, dict) and body.get("stream")
    try:
        if plan.disconnect == "after":  # mid generation, or mid stream
            async with asyncio.timeout(plan.delay_s):
                async with client.stream("POST", path, content=raw, headers=headers) as response:
                    async for _ in response.aiter_lines():
                        if streamed and rng.random() < 0.3:
                            break
            results.outcomes["hung up after the upload (too late: it finished)"] += 1
            return
        response = await client.post(path, content=raw, headers=headers)
    except TimeoutError:
        results.outcomes["hung up after the upload"] += 1
        return
    results.statuses[response.status_code] += 1
    if plan.kind in ("invalid", "overlong"):
        failure = check_error(response, "context_length_exceeded" if plan.kind == "overlong" else None)
        results.outcomes[f"refused ({plan.kind})"] += 1
    elif response.status_code != 200:
        failure = f"{plan.kind}: status {response.status_code}: {response.text[:300]}"
    else:
        try:
            results.texts += [(solo_key, text) for text in answer_texts(path, body, response)]
            failure = None
            results.outcomes["completed"] += 1
        except (AssertionError, ValueError, KeyError) as exc:
            failure = f"{plan.kind}: {exc}"
    if failure is not None:
        results.failures.append(failure)


def server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def soak(url: str, pid: int, plans: list[Plan], concurrency: int, rss_every: int, seed: int) -> Results:
    results, gate, rng = Results(), asyncio.Semaphore(concurrency), random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(plan: Plan) -> None:
            async with gate:
                try:
                    await run_one(client, url, plan, results, rng)
                except Exception as exc:  # a transport failure is a finding too
                    results.failures.append(f"{plan.kind}/{plan.disconnect}: {type(exc).__name__}: {exc}")
                results.num_done += 1
                if results.num_done % rss_every == 0:
                    results.rss_mb.append(server_rss_mb(pid))

        await asyncio.gather(*(one(plan) for plan in plans))
    return results


def solo_texts(url: str, keys: set[tuple]) -> dict[tuple, str]:
    """Each distinct greedy request alone, one at a time, on the idle server."""
    solos = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for key in sorted(keys, key=repr):
            plan = Plan("completion" if key[0] == "completion" else ("chat_tools" if key[2] else "chat"), key[1], None, 0)
            path, body, _ = request_of(plan)
            solos[key] = answer_texts(path, body, client.post(path, json=body))[0]
    return solos


def idle_state(url: str, timeout_s: float = 15.0) -> tuple[dict[str, float], dict[str, float]]:
    """The engine gauges once nothing runs, waits or holds KV (or what they are after `timeout_s`), and the
    server's own count of /v1 responses by status."""
    names = ("mps_serve_num_requests_running", "mps_serve_num_requests_waiting", "mps_serve_kv_blocks_used")
    deadline = time.monotonic() + timeout_s
    while True:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        gauges = {n: float(line.split()[-1]) for line in lines for n in names if line.startswith(n + " ")}
        if not any(gauges.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by_status: Counter = Counter()
    for line in lines:
        if line.startswith('mps_serve_http_requests_total{endpoint="/v1'):  # not /health's 503s while loading
            by_status[line.split('status="')[1].split('"')[0]] += float(line.split()[-1])
    return gauges, dict(sorted(by_status.items()))


def start_server(extra_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "server", "--log-level", "warning", "serve", "demo", "--device", "cpu",
               "--port", str(port), *extra_args]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not become healthy")


def run(num_requests: int = 1000, concurrency: int = 32, num_prompts: int = 16, disconnect_share: float = 0.2,
        rss_every: int = 100, seed: int = 0, server_args: tuple[str, ...] = ()) -> dict[str, Any]:
    plans = make_plans(num_requests, num_prompts, disconnect_share, random.Random(seed))
    process, url = start_server(list(server_args))
    try:
        start = time.perf_counter()
        results = asyncio.run(soak(url, process.pid, plans, concurrency, rss_every, seed))
        seconds = time.perf_counter() - start
        idle, server_statuses = idle_state(url)
        solos = solo_texts(url, {key for key, _ in results.texts})
    finally:
        process.terminate()
        process.wait(60)
    mismatches = [f"{key}: {text!r} != solo {solos[key]!r}" for key, text in results.texts if text != solos[key]]
    rss = results.rss_mb
    rss_change = (rss[-1] - rss[1]) / rss[1] if len(rss) >= 2 else None
    checks = {
        "no failures": not results.failures,
        "greedy texts equal their solo runs": not mismatches,
        "no 5xx": not any(s >= 500 for s in results.statuses) and not any(s.startswith("5") for s in server_statuses),
        "idle afterwards": not any(idle.values()),
        "rss within 5%": rss_change is not None and abs(rss_change) <= 0.05,
    }
    return {
        "requests": num_requests, "concurrency": concurrency, "seconds": round(seconds, 1), "checks": checks,
        "outcomes": dict(results.outcomes), "statuses": {str(k): v for k, v in sorted(results.statuses.items())},
        "server_statuses": server_statuses,
        "greedy_texts_checked": len(results.texts), "idle_gauges": idle, "rss_mb": [round(r, 1) for r in rss],
        "rss_change": None if rss_change is None else round(rss_change, 4),
        "failures": results.failures[:20], "mismatches": mismatches[:20], "ok": all(checks.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts (each one solo run at the end)")
    parser.add_argument("--rss-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    args = parser.parse_args()
    summary = run(args.requests, args.concurrency, args.prompts, rss_every=args.rss_every, seed=args.seed)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
