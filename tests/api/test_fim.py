"""Fill-in-the-middle over HTTP on a tiny random qwen3 whose tokenizer carries Qwen2.5-Coder's FIM tokens: the openai
SDK's `completions.create(suffix=...)` and llama.cpp's /infill (httpx) against a real uvicorn.

The prompt ids the engine receives are compared with the layout written out here from transformers' tokenizer,
and the greedy tokens with transformers' greedy continuation of those ids.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from tests.api.harness import RunningServer, run_app, serve, sse_events
from tests.helpers import hf_greedy, random_text

pytestmark = pytest.mark.slow


class FimServer:
    def __init__(self, running: RunningServer, hf_model, hf_tok):
        self.running, self.hf_model, self.hf_tok = running, hf_model, hf_tok
        self.requests: list = []  # every Request the engine was given, in order
        inner = running.engine.engine
        add = inner.add_request

        def recording(request) -> None:
            self.requests.append(request)
            add(request)

        inner.add_request = recording

    def tok(self, name: str) -> list[int]:
        return [self.hf_tok.convert_tokens_to_ids(name)]

    def text(self, s: str) -> list[int]:
        return self.hf_tok(s, add_special_tokens=False).input_ids if s else []

    def layout(self, prefix: str, suffix: str) -> list[int]:
        return self.tok("<|fim_prefix|>") + self.text(prefix) + self.tok("<|fim_suffix|>") + self.text(suffix) + \
            self.tok("<|fim_middle|>")

    def last(self):
        """The last request's (prompt ids, output ids)."""
        request = self.requests[-1]
        return request.token_ids[:request.num_prompt_tokens], request.output_token_ids


@pytest.fixture(scope="module")
def fim(tiny_fim_checkpoint) -> Iterator[FimServer]:
    import transformers

    from server.engine.async_engine import AsyncEngine

    path, hf_model = tiny_fim_checkpoint
    engine = AsyncEngine.from_config(EngineConfig.from_flat(model=str(path), device="cpu", dtype="float32"))
    with run_app(create_app(engine, ServerConfig(served_model_name="coder")), engine) as running:
        yield FimServer(running, hf_model, transformers.AutoTokenizer.from_pretrained(path))


def _code(rng: random.Random) -> str:
    return random_text(rng, 40).replace("<|", "<")  # text, not markup


def _stop_string(text: str) -> str:
    """Two characters from inside `text` that are not blank: the answer up to their first occurrence is known."""
    return next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip())


def test_openai_suffix_reaches_the_engine_as_fim_layout_and_matches_transformers_greedy(fim: FimServer) -> None:
    rng = random.Random()
    prefix, suffix = _code(rng), _code(rng)
    client = fim.running.client()
    out = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    prompt_ids, output_ids = fim.last()
    assert prompt_ids == fim.layout(prefix, suffix)
    assert output_ids == hf_greedy(fim.hf_model, prompt_ids, 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 12)
    chunks = list(client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=12,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert fim.last() == (prompt_ids, output_ids)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_fim_stop_tokens_end_the_middle(fim: FimServer) -> None:
    rng = random.Random()
    prefix, suffix = _code(rng), _code(rng)
    client = fim.running.client()
    full = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_string(full)
    for stream in (False, True):
        got = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=24, temperature=0,
                                        stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    # <|fim_pad|> ends a middle, not a plain completion
    pad = str(fim.tok("<|fim_pad|>")[0])
    middle = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=5, temperature=0,
                                       logit_bias={pad: 100})
    assert (middle.choices[0].finish_reason, middle.choices[0].text, middle.usage.completion_tokens) == ("stop", "", 1)
    plain = client.completions.create(model="coder", prompt=prefix, max_tokens=5, temperature=0, logit_bias={pad: 100})
    assert (plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("length", 5)


def test_the_time_budget_cuts_a_long_middle(fim: FimServer) -> None:
    client = fim.running.client()
    out = client.completions.create(model="coder", prompt="def f(", suffix=")\n", max_tokens=200, temperature=0,
                                    extra_body={"ignore_eos": True, "t_max_predict_ms": 1})
    assert out.choices[0].finish_reason == "length" and 1 <= out.usage.completion_tokens < 200


def test_fim_refusals_are_400s_naming_the_field(fim: FimServer, demo_server: RunningServer) -> None:
    client = fim.running.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="coder", prompt="a", suffix="b", echo=True)
    assert info.value.body["param"] == "echo" and "suffix" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="coder", prompt=[1, 2, 3], suffix="b")
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="coder", prompt="a", suffix="b", extra_body={"t_max_predict_ms": -5})
    assert info.value.body["param"] == "t_max_predict_ms"
    with pytest.raises(openai.BadRequestError) as info:
        demo_server.client().completions.create(model="demo", prompt="a", suffix="b")
    assert info.value.body["param"] == "suffix" and "no FIM tokens" in info.value.body["message"]
    response = demo_server.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_suffix"
    for extra in ("x", [{"filename": "a.py"}], [{"text": 3}], ["text"]):
        response = fim.running.post("/infill", {"input_prefix": "a", "input_extra": extra})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("input_extra"), extra


def test_infill_answers_llama_cpps_shape_with_the_repository_layout(fim: FimServer) -> None:
    rng = random.Random()
    body = {"input_prefix": _code(rng), "prompt": _code(rng), "input_suffix": _code(rng), "n_predict": 10,
            "temperature": 0, "ignore_eos": True, "return_tokens": True, "samplers": ["top_k"], "cache_prompt": True,
            "input_extra": [{"filename": f"lib/m{i}.py", "text": _code(rng)} for i in range(2)]}
    response = fim.running.post("/infill", body)
    assert response.status_code == 200
    out = response.json()
    prompt_ids, output_ids = fim.last()
    context = fim.tok("<|repo_name|>") + fim.text("myproject\n")
    for chunk in body["input_extra"]:
        context += fim.tok("<|file_sep|>") + fim.text(chunk["filename"] + "\n") + fim.text(chunk["text"])
    context += fim.tok("<|file_sep|>") + fim.text("filename\n")
    assert prompt_ids == context + fim.layout(body["input_prefix"] + body["prompt"], body["input_suffix"])
    assert output_ids == hf_greedy(fim.hf_model, prompt_ids, 10) == out["tokens"]
    assert out["stop"] is True and out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert (out["tokens_predicted"], out["tokens_evaluated"]) == (10, len(prompt_ids))
    assert out["model"] == "coder" and out["has_new_line"] == ("\n" in out["content"])
    assert out["timings"]["predicted_n"] == 10 and out["generation_settings"]["n_predict"] == 10

    streamed = httpx.post(f"{fim.running.url}/infill", json={**body, "stream": True}, timeout=30)
    data, _ = sse_events(streamed)
    events = [json.loads(d) for d in data]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == out["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == output_ids
    assert events[-1]["tokens_predicted"] == 10 and events[-1]["stop_type"] == "limit"


def test_infill_stops_on_the_budget_on_words_and_evaluates_only_with_n_predict_0(fim: FimServer) -> None:
    body = {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 200, "temperature": 0, "ignore_eos": True}
    timed = fim.running.post("/infill", {**body, "t_max_predict_ms": 1}).json()
    assert timed["stop_type"] == "limit" and 1 <= timed["tokens_predicted"] < 200
    full = fim.running.post("/infill", {**body, "n_predict": 24}).json()["content"]
    stop = _stop_string(full)
    worded = fim.running.post("/infill", {**body, "n_predict": 24, "stop": [stop]}).json()
    assert (worded["content"], worded["stop_type"], worded["stopping_word"]) == (full[:full.index(stop)], "word", stop)
    warmed = fim.running.post("/infill", {**body, "n_predict": 0}).json()
    assert (warmed["content"], warmed["tokens_predicted"], warmed["stop_type"]) == ("", 0, "limit")


def test_infill_needs_the_api_key_when_the_server_has_one() -> None:
    with serve(api_key="sk-test") as running:
        assert running.post("/infill", {"input_prefix": "a"}).status_code == 401


def test_ollama_generate_with_suffix_is_the_same_fill_in_the_middle(fim: FimServer) -> None:
    """Ollama's /api/generate `suffix` (Continue's Ollama autocomplete) takes /v1/completions' FIM path: the same
    prompt layout, the same greedy middle, its token count as eval_count."""
    import ollama

    rng = random.Random()
    prefix, suffix = _code(rng), _code(rng)
    client = ollama.Client(host=fim.running.url, timeout=60)
    options = {"temperature": 0, "num_predict": 12, "ignore_eos": True}
    parts = list(client.generate(model="coder", prompt=prefix, suffix=suffix, options=options, stream=True))
    prompt_ids, output_ids = fim.last()
    assert prompt_ids == fim.layout(prefix, suffix)
    assert output_ids == hf_greedy(fim.hf_model, prompt_ids, 12)
    v1 = fim.running.client().completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=12,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert "".join(p.response for p in parts) == v1.choices[0].text
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 12
    assert parts[-1].prompt_eval_count == len(prompt_ids)
