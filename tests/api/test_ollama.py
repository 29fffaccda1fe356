"""The Ollama API (/api/*) through the official `ollama` Python client against a real uvicorn: wire shapes, option
mapping, tool calls, thinking, model endpoints and Ollama's error shape on the scripted FakeEngine; greedy
answers, counts and `format` against /v1 on the demo model (random weights: only the grammar makes its output
JSON)."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import ollama
import pytest
from huggingface_hub import constants

from server.engine.types import SamplingParams
from tests.api.fake_engine import FakeEngine, Script
from tests.api.harness import RunningServer, serve, wait_until
from tests.api.tool_markup import TOOLS, hermes, random_args

WORDS = "the small model wakes up on a fresh machine and writes its own weights before it answers".split()
SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "unit": {"enum": ["C", "F"]}},
          "required": ["age", "ok", "unit"], "additionalProperties": False}


def _client(srv: RunningServer, **kw) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60, **kw)


def _prompt(rng: random.Random, n: int = 10) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _check_final(final, prompt_tokens: int, completion_tokens: int) -> None:
    """The last object's counts, and its durations (ns) adding up within the total."""
    assert final.done and final.prompt_eval_count == prompt_tokens and final.eval_count == completion_tokens
    assert final.load_duration == 0 and final.prompt_eval_duration > 0 and final.eval_duration >= 0
    assert final.total_duration >= final.prompt_eval_duration + final.eval_duration


# ---- the scripted engine: shapes and mappings ----------------------------------------------------------------

def test_chat_streaming_and_not(srv: RunningServer) -> None:
    rng = random.Random()
    pieces = [rng.choice(["Hel", "lo", " wör", "ld", " 😀", "\n"]) for _ in range(rng.randint(3, 9))]
    srv.engine.script = Script(pieces=pieces)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": _prompt(rng)}]
    out = _client(srv).chat(model="anything:latest", messages=messages)
    prompt = srv.engine.submitted[-1][1]
    assert out.model == "fake-served" and out.message.role == "assistant" and out.message.content == "".join(pieces)
    assert out.done_reason == "stop" and out.message.thinking is None and not out.message.tool_calls
    _check_final(out, len(prompt.split()), len(pieces))
    assert srv.engine.rendered[-1]["messages"] == messages
    parts = list(_client(srv).chat(model="m", messages=messages, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == "".join(pieces) and parts[-1].message.content == ""
    _check_final(parts[-1], len(prompt.split()), len(pieces))
    assert parts[-1].done_reason == "stop"


def test_options_map_to_sampling_params(srv: RunningServer) -> None:
    options = {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11, "num_predict": 7,
               "stop": ["a", "b"], "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
               "num_ctx": 10**6, "repeat_last_n": 64, "num_gpu": 99, "num_thread": 4, "mirostat": 0,
               "typical_p": 1.0}
    _client(srv).chat(model="m", messages=[{"role": "user", "content": "x"}], options=options, keep_alive="5m")
    assert srv.engine.submitted[-1][2] == SamplingParams(
        max_tokens=7, temperature=0.3, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, stop=["a", "b"], seed=11)
    for num_predict in (-1, -2, None):
        _client(srv).generate(model="m", prompt="x", options={"num_predict": num_predict}, keep_alive=0)
        assert srv.engine.submitted[-1][2].max_tokens == srv.engine.max_model_len
    out = _client(srv).generate(model="m", prompt="x", options={"num_predict": 2})
    assert out.response == "Hello," and out.done_reason == "length" and out.eval_count == 2


@pytest.mark.parametrize("call, message", [
    (lambda c: c.chat(model="m", messages=[{"role": "user", "content": "x"}], options={"mirostat": 2}),
     "options.mirostat=2 is not supported"),
    (lambda c: c.generate(model="m", prompt="x", options={"typical_p": 0.5}), "options.typical_p=0.5 is not"),
    (lambda c: c.generate(model="m", prompt="x", options={"num_predict": 0}), "options.num_predict must be"),
    (lambda c: c.generate(model="m", prompt="x", options={"temperature": -1}), "temperature must be >= 0"),
    (lambda c: c.chat(model="m", messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}]),
     "messages[0].images: images are not supported"),
    (lambda c: c.generate(model="m", prompt="x", images=[b"\x89PNG"]), "images: images are not supported"),
    (lambda c: c.generate(model="m", prompt="x", template="{{ .Prompt }}"), "template overrides are not"),
    (lambda c: c.generate(model="m", prompt="x", context=[1, 2]), "context (a previous generate's"),
    (lambda c: c.generate(model="m", prompt="x", raw=True, system="s"), "raw mode does not support"),
    (lambda c: c.chat(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True), "logprobs are not"),
    (lambda c: c.chat(model="m", messages=[{"role": "user", "content": "x"}], format={"$ref": "#"}), "format"),
    # fill-in-the-middle goes through /v1/completions' suffix: a model without FIM tokens says so
    (lambda c: c.generate(model="m", prompt="def f(", suffix="    return x"), "has no FIM tokens"),
])
def test_refusals_are_400_in_ollama_shape(srv: RunningServer, call, message: str) -> None:
    before = len(srv.engine.submitted)
    with pytest.raises(ollama.ResponseError) as info:
        call(_client(srv))
    assert info.value.status_code == 400 and message in info.value.error
    assert len(srv.engine.submitted) == before


def test_format_is_response_formats_constraint(srv: RunningServer) -> None:
    """`format` "json" and a schema become the grammars /v1's response_format json_object and json_schema give."""
    messages = [{"role": "user", "content": "x"}]
    for fmt, response_format in (("json", {"type": "json_object"}),
                                 (SCHEMA, {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}})):
        _client(srv).chat(model="m", messages=messages, format=fmt)
        ours = srv.engine.submitted[-1][2].structured
        srv.client().chat.completions.create(model="m", messages=messages, response_format=response_format)
        assert ours is not None and ours == srv.engine.submitted[-1][2].structured
    _client(srv).chat(model="m", messages=messages, format="")
    assert srv.engine.submitted[-1][2].structured is None


def test_tool_calls_in_ollama_shape(srv: RunningServer) -> None:
    rng = random.Random()
    args = [random_args(rng) for _ in range(2)]
    srv.engine.script = Script(pieces=list("Checking.\n" + hermes("get_weather", args[0]) + hermes("get_weather", args[1])))
    request = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    out = _client(srv).chat(**request)
    assert out.message.content == "Checking." and out.done_reason == "stop"
    assert [(c.function.name, dict(c.function.arguments)) for c in out.message.tool_calls] == [
        ("get_weather", args[0]), ("get_weather", args[1])]
    assert srv.engine.rendered[-1]["tools"] == TOOLS
    parts = list(_client(srv).chat(**request, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [dict(c.function.arguments) for c in calls] == args
    assert all(len(p.message.tool_calls or []) <= 1 for p in parts)  # each call in one chunk, when complete
    raw = httpx.post(f"{srv.url}/api/chat", json={**request, "stream": False}).json()
    assert [c["function"]["index"] for c in raw["message"]["tool_calls"]] == [0, 1]
    # the calls and the tool's answer go back into the conversation
    history = [*request["messages"], out.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    _client(srv).chat(model="m", messages=history, tools=TOOLS)
    rendered = srv.engine.rendered[-1]["messages"]
    assert [c["function"] for c in rendered[1]["tool_calls"]] == [
        {"name": "get_weather", "arguments": a} for a in args]
    assert rendered[2] == {"role": "tool", "content": "sunny", "name": "get_weather"}


@pytest.mark.parametrize("think, kwargs", [
    (None, {}), (False, {"enable_thinking": False}), (True, {"enable_thinking": True}),
    ("low", {"enable_thinking": True, "reasoning_effort": "low"}),
    ("max", {"enable_thinking": True, "reasoning_effort": "high"}),
])
def test_think_sets_the_templates_switch(srv: RunningServer, think, kwargs: dict) -> None:
    # the fake template opens `<think>` itself when thinking is on; the model then writes no opening tag
    opening = [] if kwargs.get("enable_thinking") else ["<think>"]
    srv.engine.script = Script(pieces=[*opening, "\nweigh", " it", "</think>", "\n\n", "Answer", "."])
    out = _client(srv).chat(model="m", messages=[{"role": "user", "content": "q"}], think=think)
    assert srv.engine.rendered[-1]["kwargs"] == kwargs
    assert out.message.thinking == "weigh it" and out.message.content == "Answer."
    parts = list(_client(srv).generate(model="m", prompt="q", think=think, stream=True))
    assert srv.engine.rendered[-1]["kwargs"] == kwargs
    assert "".join(p.thinking or "" for p in parts) == "weigh it" and "".join(p.response for p in parts) == "Answer."


def test_generate_templates_the_prompt_unless_raw(srv: RunningServer) -> None:
    out = _client(srv).generate(model="m", prompt="tell me", system="be brief")
    assert srv.engine.rendered[-1]["messages"] == [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "tell me"}]
    assert srv.engine.submitted[-1][1] == "<|system|> be brief\n<|user|> tell me\n<|assistant|>"
    assert out.response == "Hello, world!"
    renders = len(srv.engine.rendered)
    srv.engine.script = Script(pieces=["<think>", "raw"])
    out = _client(srv).generate(model="m", prompt="<s>[INST] hi [/INST]", raw=True)
    assert srv.engine.submitted[-1][1] == "<s>[INST] hi [/INST]" and len(srv.engine.rendered) == renders
    assert out.response == "<think>raw" and out.thinking is None  # raw output stays raw


def test_load_requests_generate_nothing(srv: RunningServer) -> None:
    before = len(srv.engine.submitted)
    assert _client(srv).chat(model="m", messages=[]).done_reason == "load"
    out = _client(srv).generate(model="m", keep_alive=0)
    assert out.done and out.done_reason == "load" and out.response == ""
    assert len(srv.engine.submitted) == before


def test_model_endpoints(srv: RunningServer) -> None:
    client = _client(srv)
    names = [m.model for m in client.list().models]
    assert names == ["fake-served", "alias-a"]
    entry = client.list().models[0]
    assert entry.size == srv.engine.describe().weight_bytes and len(entry.digest) == 64
    assert entry.details.family == "fake" and entry.details.parameter_size == "1.2M"
    assert entry.details.quantization_level == "BF16" and entry.details.format == "safetensors"
    show = client.show("anything")
    assert show.capabilities == ["completion", "tools", "thinking"] and show.template.startswith("{{ messages }}")
    assert show.modelinfo["general.architecture"] == "fake" and show.modelinfo["fake.context_length"] == 4096
    assert show.parameters == "num_ctx 4096"
    running = client.ps().models
    assert [m.model for m in running] == names and running[0].context_length == 4096 and running[0].size_vram == 0
    assert running[0].expires_at.year == 9999
    version = srv.get("/api/version").json()
    assert version["version"] == "0.33.0" and version["mps_serve_version"]


def test_pull_and_delete(srv: RunningServer, monkeypatch, tmp_path) -> None:
    client = _client(srv)
    events = list(client.pull("fake-served", stream=True))
    assert events[-1].status == "success" and "this server serves" in events[0].status
    assert client.pull("alias-a").status == "success"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("Qwen/Qwen3-0.6B")
    assert info.value.status_code == 503 and "HF_HUB_OFFLINE=1" in info.value.error
    with pytest.raises(ollama.ResponseError, match="HF_HUB_OFFLINE=1"):  # streamed: the error is the one line
        list(client.pull("Qwen/Qwen3-0.6B", stream=True))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the Hub is out of reach
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("Qwen/Qwen3-0.6B")
    assert info.value.status_code == 502 and "cannot reach the Hugging Face Hub" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("not a repo id")
    assert info.value.status_code == 400 and "invalid model name" in info.value.error
    # delete: a repo in the cache goes; the served model and unknown ones are refused
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    for name, status in (("fake-served", 400), ("alias-a", 400), ("fake-model", 400), ("org/other", 404)):
        with pytest.raises(ollama.ResponseError) as info:
            client.delete(name)
        assert info.value.status_code == status and info.value.error
    assert client.delete("org/tiny").status == "success"
    assert not (tmp_path / "models--org--tiny").exists()


@pytest.mark.parametrize("method, path, body, status, message", [
    ("POST", "/api/nothing", {}, 404, "no such route"),
    ("GET", "/api/chat", None, 405, "Method GET is not allowed"),
    ("POST", "/api/chat", {"messages": 3}, 400, "messages: Input should be a valid list"),
    ("POST", "/api/generate", {"prompt": "x", "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("POST", "/api/chat", "{not json", 400, "not valid JSON"),
    ("POST", "/api/show", {}, 400, "model is required"),
    ("POST", "/api/embed", {"input": "x"}, 400, "not an embedding model"),
    ("POST", "/api/embeddings", {"prompt": "x"}, 400, "not an embedding model"),
])
def test_errors_in_ollama_shape(srv: RunningServer, method: str, path: str, body, status: int, message: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body) if body is not None else None
    response = httpx.request(method, f"{srv.url}{path}", content=content, timeout=30)
    assert response.status_code == status and list(response.json()) == ["error"]
    assert message in response.json()["error"]


def test_an_engine_failure_mid_stream_is_one_error_line(srv: RunningServer) -> None:
    srv.engine.script = Script(pieces=["a", "b", "c"], error_after=2)
    with httpx.stream("POST", f"{srv.url}/api/generate", json={"prompt": "x", "raw": True}, timeout=30) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines()]
    assert [line.get("response") for line in lines[:-1]] == ["a", "b"] and set(lines[-1]) == {"error"}
    with pytest.raises(ollama.ResponseError, match="Internal server error"):
        list(_client(srv).chat(model="m", messages=[{"role": "user", "content": "x"}], stream=True))


@pytest.mark.parametrize("path, body", [("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/api/generate", {"prompt": "hi", "stream": False})])
def test_a_client_that_leaves_aborts_its_request(path: str, body: dict) -> None:
    engine = FakeEngine(Script(pieces=["tok"] * 10_000, delay_s=0.01))
    with serve(engine) as running:
        with httpx.Client(timeout=30) as client:
            try:
                with client.stream("POST", f"{running.url}{path}", json=body, timeout=0.5) as response:
                    next(response.iter_lines())  # streaming: one line read, then the client goes away
            except httpx.ReadTimeout:
                pass  # not streaming: nothing comes before the client gives up
        wait_until(lambda: engine.aborted == [engine.submitted[0][0]])
        wait_until(lambda: not engine.running)


def test_the_api_key_guards_api_paths() -> None:
    with serve(api_key="sk-test") as running:
        with pytest.raises(ollama.ResponseError) as info:
            _client(running).list()
        assert info.value.status_code == 401 and "API key" in info.value.error
        authed = _client(running, headers={"Authorization": "Bearer sk-test"})
        assert [m.model for m in authed.list().models] == ["fake-model"]
        assert running.get("/health").status_code == 200


# ---- what editors and agents send (README "Editors and agents"), as their sources build the requests --------

def test_continue_requests(srv: RunningServer) -> None:
    """Continue's Ollama provider: /api/show by `name` (num_ctx read from `parameters`), chat and raw generate
    with its options (undefined ones dropped), keep_alive in seconds; tools only with stream false."""
    show = srv.post("/api/show", {"name": "qwen2.5-coder:7b"}).json()
    key, value = show["parameters"].split("\n")[0].split()
    assert key == "num_ctx" and int(value) == srv.engine.max_model_len
    options = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "num_predict": 3, "stop": ["```"], "num_ctx": 8192,
               "min_p": 0.05}
    chat = {"model": "qwen2.5-coder:7b", "messages": [{"role": "user", "content": "hi"}], "options": options,
            "keep_alive": 1800, "stream": True}
    lines = [json.loads(line) for line in srv.post("/api/chat", chat).text.splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == "Hello, world" and lines[-1]["done"]
    srv.engine.script = Script(pieces=list(hermes("get_weather", {"city": "Oslo"})))
    tools = [{"type": "function", "function": TOOLS[0]["function"]}]
    answer = srv.post("/api/chat", {**chat, "tools": tools, "stream": False,
                                    "options": {**options, "num_predict": -1}}).json()
    assert answer["message"]["tool_calls"][0]["function"] == {"index": 0, "name": "get_weather",
                                                              "arguments": {"city": "Oslo"}}
    raw = {"model": "qwen2.5-coder:7b", "prompt": "def add(a, b):", "raw": True, "options": options,
           "keep_alive": 1800, "stream": True}
    lines = [json.loads(line) for line in srv.post("/api/generate", raw).text.splitlines()]
    assert srv.engine.submitted[-1][1] == "def add(a, b):" and lines[-1]["done_reason"] == "length"


def test_zed_and_copilot_discovery(srv: RunningServer) -> None:
    """Zed: /api/tags, then /api/show per model for the context length and capabilities, then streamed /api/chat
    with think and keep_alive. VS Code Copilot (BYOK Ollama): /api/version at least 0.6.4, /api/tags, /api/show;
    its chat goes to /v1/chat/completions on the same base URL."""
    names = [m["name"] for m in srv.get("/api/tags").json()["models"]]
    show = srv.post("/api/show", {"model": names[0]}).json()
    arch = show["model_info"]["general.architecture"]
    assert show["model_info"][f"{arch}.context_length"] == srv.engine.max_model_len
    assert {"tools", "thinking"} <= set(show["capabilities"]) and "vision" not in show["capabilities"]
    assert tuple(map(int, srv.get("/api/version").json()["version"].split("."))) >= (0, 6, 4)
    body = {"model": names[0], "messages": [{"role": "user", "content": "hi"}], "stream": True, "think": False,
            "keep_alive": "5m", "options": {"num_ctx": show["model_info"][f"{arch}.context_length"], "stop": []}}
    lines = [json.loads(line) for line in srv.post("/api/chat", body).text.splitlines()]
    assert all(line["message"]["role"] == "assistant" for line in lines) and lines[-1]["done"]
    out = srv.client().chat.completions.create(model=names[0], messages=body["messages"])
    assert out.choices[0].message.content == "Hello, world!"


def test_codex_oss_probe_and_pull(srv: RunningServer) -> None:
    """Codex CLI --oss: the model named by -m is looked up in /v1/models (or /api/tags), and pulled through
    /api/pull only when absent; the pull stream ends at status "success"."""
    ids = [m["id"] for m in srv.get("/v1/models").json()["data"]]
    assert "fake-served" in ids and "fake-served" in [m["name"] for m in srv.get("/api/tags").json()["models"]]
    events = [json.loads(line) for line in srv.post("/api/pull", {"model": "fake-served", "stream": True}).text.splitlines()]
    assert events[-1] == {"status": "success"}


# ---- the demo model: the same answers as /v1 -----------------------------------------------------------------

@pytest.mark.slow
def test_greedy_chat_and_generate_match_v1(demo_server: RunningServer) -> None:
    rng = random.Random()
    messages = [{"role": "user", "content": _prompt(rng)}]
    options = {"temperature": 0, "num_predict": 24}
    v1 = demo_server.client().chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    out = _client(demo_server).chat(model="demo", messages=messages, options=options)
    assert out.message.content == v1.choices[0].message.content
    _check_final(out, v1.usage.prompt_tokens, v1.usage.completion_tokens)
    assert out.done_reason == v1.choices[0].finish_reason
    parts = list(_client(demo_server).chat(model="demo", messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == v1.choices[0].message.content
    _check_final(parts[-1], v1.usage.prompt_tokens, v1.usage.completion_tokens)
    # generate renders its prompt as that one user turn
    generated = _client(demo_server).generate(model="demo", prompt=messages[0]["content"], options=options)
    assert generated.response == v1.choices[0].message.content
    # raw: the same text as /v1/completions
    prompt = _prompt(rng)
    completion = demo_server.client().completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0)
    parts = list(_client(demo_server).generate(model="demo", prompt=prompt, raw=True, stream=True,
                                               options={"temperature": 0, "num_predict": 16}))
    assert "".join(p.response for p in parts) == completion.choices[0].text
    _check_final(parts[-1], completion.usage.prompt_tokens, completion.usage.completion_tokens)


@pytest.mark.slow
def test_think_false_matches_v1_without_thinking(demo_server: RunningServer) -> None:
    messages = [{"role": "user", "content": _prompt(random.Random())}]
    v1 = demo_server.client().chat.completions.create(
        model="demo", messages=messages, max_tokens=16, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = _client(demo_server).chat(model="demo", messages=messages, think=False,
                                    options={"temperature": 0, "num_predict": 16})
    assert out.message.content == v1.choices[0].message.content and out.eval_count == v1.usage.completion_tokens


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_format_schema(demo_server: RunningServer, stream: bool) -> None:
    seed = random.randrange(1000)
    messages = [{"role": "user", "content": "how old, and ok?"}]
    kw = dict(model="demo", messages=messages, think=False, options={"seed": seed, "num_predict": 60})
    if stream:
        text = "".join(p.message.content for p in _client(demo_server).chat(format=SCHEMA, stream=True, **kw))
    else:
        out = _client(demo_server).chat(format=SCHEMA, **kw)
        assert out.done_reason == "stop"
        text = out.message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    generated = _client(demo_server).generate(model="demo", prompt="age?", format=SCHEMA, think=False,
                                              options={"seed": seed, "num_predict": 60})
    jsonschema.validate(json.loads(generated.response), SCHEMA)
