"""Several models on one server (server/api/model_registry.py) with real engines on tiny random checkpoints (CPU):
routing by name, load on first use, one load for concurrent first requests, idle unload, LRU eviction under a
small budget, no request cut by an eviction, and each protocol's 404."""

from __future__ import annotations

import gc
import random
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import ollama
import openai
import pytest

from server.api.app import create_app
from server.api.model_registry import ModelRegistry, ModelSpec
from server.config import EngineConfig, ServerConfig
from tests.api.harness import RunningServer, run_app, wait_until
from tests.helpers import build_tiny

pytestmark = pytest.mark.slow
WORDS = "a quiet river carries small stones past the old mill toward the sea".split()
KV_BYTES = 1 << 20  # a small KV cache per engine: several engines share the test machine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Three tiny llamas of one size (different random weights), and a qwen3."""
    root = tmp_path_factory.mktemp("many")
    paths = {}
    for name, arch, seed in (("llama-a", "llama", 0), ("llama-b", "llama", 1), ("llama-c", "llama", 2),
                             ("qwen", "qwen3", 3)):
        build_tiny(arch, root / name, seed=seed)
        paths[name] = str(root / name)
    return paths


def _engine_config(path: str, kv_bytes: int = KV_BYTES) -> EngineConfig:
    return EngineConfig.from_flat(model=path, device="cpu", kv_cache_memory_bytes=kv_bytes)


class Builds:
    """Counts the loads of each model (the factory run_server would get)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.built: list[weakref.ref] = []  # every engine built, to check that an unloaded one is freed
        self.lock = threading.Lock()

    def spec(self, name: str, path: str, aliases: tuple[str, ...] = (), kv_bytes: int = KV_BYTES) -> ModelSpec:
        from server.engine.async_engine import AsyncEngine
        from server.engine.model_size import estimated_resident_bytes

        def build():
            with self.lock:
                self.count[name] = self.count.get(name, 0) + 1
            engine = AsyncEngine.from_config(_engine_config(path, kv_bytes))
            self.built.append(weakref.ref(engine.engine))
            return engine

        return ModelSpec(name, aliases, build, estimated_resident_bytes(_engine_config(path, kv_bytes)))


def _serve(specs: list[ModelSpec], budget: int, keep_alive_s: float = 300.0):
    registry = ModelRegistry(specs, budget, keep_alive_s)
    return run_app(create_app(None, ServerConfig(), models=registry))


def _loaded(running: RunningServer) -> list[str]:
    return sorted(m["name"] for m in running.get("/api/ps").json()["models"])


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(8))


def _reference(path: str, prompt: str, max_tokens: int) -> str:
    from server.engine.engine import Engine
    from server.engine.types import SamplingParams

    engine = Engine.from_config(_engine_config(path))
    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)).text


def test_routes_by_name_and_loads_on_first_use(checkpoints) -> None:
    builds = Builds()
    specs = [builds.spec("llama-a", checkpoints["llama-a"], aliases=("coder",)),
             builds.spec("qwen", checkpoints["qwen"]), builds.spec("demo", "demo")]
    with _serve(specs, budget=1 << 34) as running:
        client = running.client()
        listed = {m.id: m.model_dump() for m in client.models.list().data}
        assert set(listed) == {"llama-a", "coder", "qwen", "demo"}
        assert not any(card["loaded"] for card in listed.values())
        assert builds.count == {}
        prompt = _prompt(random.randrange(1 << 30))
        answers = {}
        for name, path in (("coder", checkpoints["llama-a"]), ("qwen", checkpoints["qwen"])):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            assert out.model == name
            answers[name] = out.choices[0].text
            assert answers[name] == _reference(path, prompt, 12)
        assert answers["coder"] != answers["qwen"]  # two random models, two different answers
        assert builds.count == {"llama-a": 1, "qwen": 1}
        listed = {m.id: m.model_dump() for m in client.models.list().data}
        assert [listed[n]["loaded"] for n in ("llama-a", "coder", "qwen", "demo")] == [True, True, True, False]
        tags = {m["name"]: m["loaded"] for m in running.get("/api/tags").json()["models"]}
        assert tags == {"llama-a": True, "coder": True, "qwen": True, "demo": False}
        metrics = running.metrics()
        assert 'mps_serve_models_resident{model="qwen"} 1.0' in metrics
        assert 'mps_serve_models_resident{model="demo"} 0.0' in metrics
        assert 'mps_serve_models_kv_blocks{model="qwen",state="free"}' in metrics


def test_concurrent_first_requests_share_one_load(checkpoints) -> None:
    builds = Builds()
    with _serve([builds.spec("llama-a", checkpoints["llama-a"]), builds.spec("llama-b", checkpoints["llama-b"])],
                budget=1 << 34) as running:
        client = running.client()

        def ask(i: int) -> str:
            stream = client.completions.create(model="llama-b", prompt=f"request {i}", max_tokens=4, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(ask, range(6)))
        assert len(results) == 6
        assert builds.count == {"llama-b": 1}
        assert _loaded(running) == ["llama-b"]


def test_idle_unload_after_keep_alive_and_ollama_keep_alive(checkpoints) -> None:
    builds = Builds()
    specs = [builds.spec("llama-a", checkpoints["llama-a"]), builds.spec("llama-b", checkpoints["llama-b"])]
    with _serve(specs, budget=1 << 34, keep_alive_s=0.5) as running:
        running.client().completions.create(model="llama-a", prompt="hi", max_tokens=2)
        assert _loaded(running) == ["llama-a"]
        wait_until(lambda: _loaded(running) == [], timeout_s=10)
        gc.collect()
        assert builds.built[0]() is None  # the unloaded engine (model, KV cache) is freed
        client = ollama.Client(host=running.url)
        client.generate(model="llama-b", prompt="hi", raw=True, options={"num_predict": 2}, keep_alive=-1)
        ps = running.get("/api/ps").json()["models"]
        assert [m["expires_at"] for m in ps] == ["9999-12-31T23:59:59Z"]
        client.generate(model="llama-a", prompt="hi", raw=True, options={"num_predict": 2}, keep_alive="1h")
        assert _loaded(running) == ["llama-a", "llama-b"]
        client.generate(model="llama-a", prompt="hi", raw=True, options={"num_predict": 2}, keep_alive=0)
        wait_until(lambda: _loaded(running) == ["llama-b"], timeout_s=10)
        assert builds.count == {"llama-a": 2, "llama-b": 1}
        bad = running.post("/api/generate", {"model": "llama-a", "prompt": "hi", "raw": True, "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_lru_eviction_under_a_small_budget_and_too_large_refused(checkpoints) -> None:
    builds = Builds()
    specs = [builds.spec(n, checkpoints[n]) for n in ("llama-a", "llama-b", "llama-c")]
    specs.append(builds.spec("demo", "demo", kv_bytes=16 * KV_BYTES))  # its KV cache alone passes the budget
    size = specs[0].size_bytes
    assert {s.size_bytes for s in specs[:3]} == {size}
    budget = int(size * 2.2)  # two tiny llamas fit, not three
    assert specs[3].size_bytes > budget
    with _serve(specs, budget=budget) as running:
        client = running.client()
        for name in ("llama-a", "llama-b", "llama-a", "llama-c"):
            client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert _loaded(running) == ["llama-a", "llama-c"]  # llama-b was the least recently used
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="demo", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert f"{specs[3].size_bytes / 2**30:.2f} GiB" in err.value.message
        assert f"{budget / 2**30:.2f} GiB" in err.value.message
        assert _loaded(running) == ["llama-a", "llama-c"]  # nothing was evicted for a model that cannot fit


def test_an_eviction_never_cuts_a_request_in_flight(checkpoints) -> None:
    builds = Builds()
    specs = [builds.spec("llama-a", checkpoints["llama-a"]), builds.spec("llama-b", checkpoints["llama-b"])]
    with _serve(specs, budget=int(specs[0].size_bytes * 1.5)) as running:
        body = {"model": "llama-a", "prompt": "once upon", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            busy = running.post("/v1/completions", {"model": "llama-b", "prompt": "hi", "max_tokens": 2})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_memory_busy"
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        finish = [line for line in rest if '"finish_reason":"length"' in line.replace(" ", "")]
        assert finish, "the stream of llama-a ran to its length"
        out = running.client().completions.create(model="llama-b", prompt="hi", max_tokens=2)
        assert out.model == "llama-b"
        assert _loaded(running) == ["llama-b"]  # llama-a, idle now, made room


def test_unknown_model_is_a_404_in_each_protocol(checkpoints) -> None:
    builds = Builds()
    with _serve([builds.spec("llama-a", checkpoints["llama-a"]), builds.spec("qwen", checkpoints["qwen"])],
                budget=1 << 34) as running:
        with pytest.raises(openai.NotFoundError) as err:
            running.client().completions.create(model="nope", prompt="hi")
        assert err.value.body["code"] == "model_not_found"
        assert "llama-a" in err.value.message and "qwen" in err.value.message
        claude = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as err:
            claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
        assert "llama-a" in err.value.body["error"]["message"]
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=running.url).generate(model="nope", prompt="hi")
        assert err.value.status_code == 404 and "qwen" in err.value.error
        assert builds.count == {}


def test_a_failed_load_is_a_503_and_the_next_request_tries_again(checkpoints, tmp_path) -> None:
    builds = Builds()
    missing = tmp_path / "later"
    spec = builds.spec("llama-a", checkpoints["llama-a"])

    def build_late():
        from server.engine.async_engine import AsyncEngine

        builds.count["late"] = builds.count.get("late", 0) + 1
        return AsyncEngine.from_config(_engine_config(str(missing)))

    late = ModelSpec("late", (), build_late, spec.size_bytes)  # its checkpoint is written after the first try
    with _serve([spec, late], budget=1 << 34) as running:
        failed = running.post("/v1/completions", {"model": "late", "prompt": "hi", "max_tokens": 2})
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_load_failed"
        assert "'late' could not be loaded" in failed.json()["error"]["message"]
        build_tiny("llama", missing, seed=5)
        out = running.client().completions.create(model="late", prompt="hi", max_tokens=2)
        assert out.model == "late" and builds.count == {"late": 2}
