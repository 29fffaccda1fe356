"""Hostile requests against the structured and agent paths (issue 59), each timed, while a client polls `/health`.

    PYTHONPATH=. python3 benchmarks/hostile_health.py [--repeat 3] [--json FILE]

`mps-serve serve` (the demo model, CPU) runs in a child process. One thread GETs /health every 10 ms for the whole
run; each case is sent alone, `--repeat` times, and reported with its statuses, its slowest time and the slowest /health
answer while it ran.
Checks: every case answers with the status it should (a 2xx or a 4xx, never a 5xx) and /health stays under 100 ms.
Prints one JSON line per case and a summary; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

USER = [{"role": "user", "content": "describe the weather"}]
HEALTH_BOUND_S = 0.1
JSON = {"content-type": "application/json"}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _optional(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def _chat(**extra: Any) -> dict:
    return {"messages": USER, "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}, **extra}


def _number_tool() -> dict:
    return {"messages": USER, "max_tokens": 64, "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "number"}}}}]}


# name -> (path, body, the statuses it may answer with)
CASES: dict[str, tuple[str, dict, set[int]]] = {
    "schema_8000_optional_properties": ("/v1/chat/completions", _chat(response_format=_schema_format(_optional(8000))),
                                        {400}),
    "schema_16000_optional_properties": ("/v1/chat/completions",
                                         _chat(response_format=_schema_format(_optional(16000))), {400}),
    "schema_400_optional_properties": ("/v1/chat/completions", _chat(response_format=_schema_format(_optional(400))),
                                       {200}),
    "schema_ref_to_itself": ("/v1/chat/completions", _chat(response_format=_schema_format({"$ref": "#"})), {400}),
    "const_spelling_im_end": ("/v1/chat/completions",
                              _chat(response_format=_schema_format({"const": "<|im_end|>"})), {200}),
    "stop_10000_sequences": ("/v1/chat/completions", _chat(stop=[f"s{i}" for i in range(10_000)], stream=True), {400}),
    "logit_bias_301": ("/v1/chat/completions", _chat(logit_bias={str(i): 1 for i in range(301)}), {400}),
    "tools_129": ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": f"f{i}"}}
                                                       for i in range(129)]), {400}),
    "max_tokens_true": ("/v1/chat/completions", _chat(max_tokens=True), {400}),
    "max_tokens_1e30": ("/v1/chat/completions", _chat(max_tokens=1e30), {400}),
    "messages_forced_number_tool": ("/v1/messages", _number_tool(), {200}),
    "messages_thinking_budget_1024": ("/v1/messages", {"messages": USER, "max_tokens": 1100,
                                                       "thinking": {"type": "enabled", "budget_tokens": 1024}}, {200}),
    "messages_stop_10000_sequences": ("/v1/messages", {"messages": USER, "max_tokens": 8,
                                                       "stop_sequences": [f"s{i}" for i in range(10_000)]}, {400}),
    "responses_background": ("/v1/responses", {"input": "q", "background": True}, {400}),
    "responses_include_logprobs": ("/v1/responses", {"input": "q", "include": ["message.output_text.logprobs"]},
                                   {400}),
}


class HealthPoller(threading.Thread):
    """GET /health every 10 ms; `worst(since)` is the slowest answer that started after `since`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, int]] = []  # (start, seconds, status)
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                status = client.get(f"{self.url}/health").status_code
                self.samples.append((start, time.monotonic() - start, status))
                time.sleep(0.01)

    def worst(self, since: float) -> float:
        return max((s for t, s, _ in self.samples if t >= since), default=0.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "serve", "--device", "cpu", "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def run_cases(url: str, poller: HealthPoller, repeat: int) -> list[dict[str, Any]]:
    start = time.monotonic()
    time.sleep(0.5 * repeat)  # the noise floor: /health alone (a shared machine's other work shows here)
    rows = [{"case": "idle", "statuses": [], "seconds_max": 0.0, "health_max_ms": round(poller.worst(start) * 1e3, 1),
             "ok": True}]
    with httpx.Client(timeout=300) as client:
        for name, (path, body, expected) in CASES.items():
            statuses, seconds, worst = set(), 0.0, 0.0
            raw = json.dumps(body).encode()  # encoded here: the poller shares this process's GIL
            for _ in range(repeat):
                time.sleep(0.1)  # a few /health samples between requests
                start = time.monotonic()
                statuses.add(client.post(f"{url}{path}", content=raw, headers=JSON).status_code)
                seconds = max(seconds, time.monotonic() - start)
                time.sleep(0.02)
                worst = max(worst, poller.worst(start))
            rows.append({"case": name, "statuses": sorted(statuses), "seconds_max": round(seconds, 3),
                         "health_max_ms": round(worst * 1e3, 1),
                         "ok": statuses <= expected and worst < HEALTH_BOUND_S})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="requests per case (default: 3)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(port)
    try:
        _wait_ready(url)
        poller = HealthPoller(url)
        poller.start()
        rows = run_cases(url, poller, args.repeat)
        poller.stop.set()
        poller.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for row in rows:
        print(json.dumps(row))
    failed = [r["case"] for r in rows if not r["ok"]]
    print(json.dumps({"cases": len(rows), "failed": failed,
                      "health_max_ms": max(r["health_max_ms"] for r in rows)}))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(rows, out, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
