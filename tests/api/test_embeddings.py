"""POST /v1/embeddings: pooled hidden states of a tiny random Qwen3 embedding checkpoint (saved as transformers'
bare Qwen3Model with a sentence-transformers pooling config, as Qwen3-Embedding is) against transformers' last
hidden state, through the official openai client and a real uvicorn."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from tests.api.harness import RunningServer, run_app, serve
from tests.helpers import ENGINE_KW, randomize, tiny_configs, write_byte_tokenizer

TEXTS = ["the small model wakes up", "a", "éß 😀 embeddings, pooled from the last token"]


def _write_embedding_checkpoint(path, pooling_key: str = "pooling_mode_lasttoken") -> torch.nn.Module:
    import transformers as tf

    cfg_cls, _, kwargs = tiny_configs()["qwen3"]
    cfg = cfg_cls(**kwargs)  # tie_word_embeddings=False, and no lm_head saved: as Qwen3-Embedding-4B/8B
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Qwen3Model(cfg).eval()
    randomize(model, seed=3)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, pooling_key: True}))
    return model


def _token_ids(path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids


def _reference(model: torch.nn.Module, ids: list[int]) -> list[float]:
    ids = torch.tensor([ids])
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).tolist()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Iterator[tuple[RunningServer, torch.nn.Module, object]]:
    from server.engine.async_engine import AsyncEngine

    path = tmp_path_factory.mktemp("qwen3_embedding")
    hf_model = _write_embedding_checkpoint(path)
    config = EngineConfig.from_flat(model=str(path), **ENGINE_KW)
    engine = AsyncEngine.from_config(config)
    with run_app(create_app(engine, ServerConfig(served_model_name="embedder")), engine) as running:
        yield running, hf_model, path


def test_embeddings_match_transformers(embedder) -> None:
    running, hf_model, path = embedder
    client = running.client()
    out = client.embeddings.create(model="any", input=TEXTS, encoding_format="float")
    assert out.model == "embedder" and [d.index for d in out.data] == [0, 1, 2]
    for data, text in zip(out.data, TEXTS, strict=True):
        assert len(data.embedding) == 64
        assert data.embedding == pytest.approx(_reference(hf_model, _token_ids(path, text)), abs=1e-4)
    assert out.usage.prompt_tokens == sum(len(_token_ids(path, t)) for t in TEXTS) == out.usage.total_tokens
    default = client.embeddings.create(model="any", input=TEXTS[0])  # openai-python asks for base64 and decodes it
    assert default.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)
    ids = client.embeddings.create(model="any", input=[_token_ids(path, TEXTS[2])], encoding_format="float")
    assert ids.data[0].embedding == pytest.approx(out.data[2].embedding, abs=1e-5)


def test_dimensions_truncate_and_renormalize(embedder) -> None:
    running, _, _ = embedder
    full = running.client().embeddings.create(model="m", input="hello", encoding_format="float").data[0].embedding
    raw = running.post("/v1/embeddings", {"input": "hello", "dimensions": 16, "encoding_format": "base64"}).json()
    short = list(struct.unpack("<16f", base64.b64decode(raw["data"][0]["embedding"])))
    norm = math.sqrt(sum(v * v for v in full[:16]))
    assert short == pytest.approx([v / norm for v in full[:16]], abs=1e-6)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [1, 999]}, "input"),
    ({"input": "x" * 600}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": 3}, "input"),
    ({"input": [["a"]]}, "input"),
    ({"input": [True, 2]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
])
def test_malformed_fields_are_400(embedder, body: dict, param: str) -> None:
    running, _, _ = embedder
    r = running.post("/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_a_generative_model_refuses_with_400() -> None:
    with serve() as running:  # the scripted engine serves no embedding model
        r = httpx.post(f"{running.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
        with pytest.raises(openai.BadRequestError, match="not an embedding model"):
            running.client().embeddings.create(model="m", input="hi")


@pytest.mark.parametrize("key, mode", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "first")])
def test_pooling_modes_come_from_the_checkpoint(tmp_path, key: str, mode: str) -> None:
    from server.engine.embeddings import Pooling, read_pooling

    assert read_pooling(tmp_path) is None
    _write_embedding_checkpoint(tmp_path, key)
    assert read_pooling(tmp_path) == Pooling(mode, normalize=True)


def test_ollama_embed_and_embeddings_match_transformers(embedder) -> None:
    import ollama

    running, hf_model, path = embedder
    client = ollama.Client(host=running.url, timeout=60)
    out = client.embed(model="any", input=TEXTS)
    assert out.model == "embedder" and len(out.embeddings) == len(TEXTS)
    for vector, text in zip(out.embeddings, TEXTS, strict=True):
        assert vector == pytest.approx(_reference(hf_model, _token_ids(path, text)), abs=1e-4)
    assert out.prompt_eval_count == sum(len(_token_ids(path, t)) for t in TEXTS) and out.total_duration > 0
    short = client.embed(model="any", input=TEXTS[0], dimensions=16).embeddings[0]
    norm = math.sqrt(sum(v * v for v in out.embeddings[0][:16]))
    assert short == pytest.approx([v / norm for v in out.embeddings[0][:16]], abs=1e-6)
    older = client.embeddings(model="any", prompt=TEXTS[2]).embedding
    assert older == pytest.approx(out.embeddings[2], abs=1e-6)
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="any", input=["ok", ""])
    assert info.value.status_code == 400 and info.value.error
