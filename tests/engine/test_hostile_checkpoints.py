"""Hostile checkpoints and templates are refused with an error that says what and where, before harm is done: a
chat template that leaves its sandbox, loops or recurses without end, or builds huge values; a safetensors header
that lies about sizes or offsets; a config.json with absurd sizes (refused before allocating)."""

from __future__ import annotations

import json
import shutil
import struct
import time

import pytest

from server.engine.engine import Engine
from server.engine.tokenizer import Tokenizer
from server.engine.types import InvalidRequestError, ModelLoadError
from tests.helpers import ENGINE_KW

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from server.engine.demo import ensure_demo_model

    tok = Tokenizer.from_pretrained(ensure_demo_model())
    tok.render_time_limit_s = 0.5
    return tok


@pytest.mark.parametrize("template, says", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox forbids"),
    ("{{ messages.__class__.__init__.__globals__ }}", "sandbox forbids"),
    ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "ran longer than 0.5 s"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "ran longer than 0.5 s"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed without end"),
    ("{{ 'a' * 10**9 }}", "sandbox forbids"),
    ("{{ [0] * 100000000 }}", "sandbox forbids"),
    ("{{ 7 ** 100000000 }}", "sandbox forbids"),
])
def test_a_hostile_chat_template_is_stopped(tokenizer: Tokenizer, template: str, says: str) -> None:
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=says):
        tokenizer.apply_chat_template(MESSAGES, chat_template=template)
    assert time.monotonic() - start < 5
    # the tokenizer renders on: tracing is off again and ordinary templates work
    assert tokenizer.apply_chat_template(MESSAGES * 2, chat_template="{% for m in messages %}{{ m.content * 2 }}{% endfor %}") == "hi" * 4


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


def _lie(path, change) -> None:
    """Rewrite the safetensors header of `path` through `change(header) -> header`, the data untouched."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + size]), raw[8 + size:]
    encoded = json.dumps(change(header)).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _grow_shape(h):
    name = _first_tensor(h)
    return {**h, name: {**h[name], "shape": [s * 4 for s in h[name]["shape"]]}}


def _past_the_end(h):
    name = _first_tensor(h)
    start, _ = h[name]["data_offsets"]
    return {**h, name: {**h[name], "data_offsets": [start, start + 10**12]}}


def _overlap(h):
    names = [k for k in h if k != "__metadata__"]
    return {**h, names[1]: {**h[names[1]], "data_offsets": h[names[0]]["data_offsets"]}}


@pytest.mark.parametrize("change", [_grow_shape, _past_the_end, _overlap])
def test_a_safetensors_header_that_lies_is_refused_naming_the_file(llama, tmp_path, change) -> None:
    model_dir = shutil.copytree(llama, tmp_path / "model")
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    _lie(shard, change)
    with pytest.raises(ModelLoadError, match=rf"{shard.name}.*(corrupt|header)"):
        Engine.from_pretrained(str(model_dir), **ENGINE_KW)


def test_a_header_length_past_the_file_is_refused(llama, tmp_path) -> None:
    model_dir = shutil.copytree(llama, tmp_path / "model")
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    shard.write_bytes(struct.pack("<Q", 2**62) + shard.read_bytes()[8:])
    with pytest.raises(ModelLoadError, match=shard.name):
        Engine.from_pretrained(str(model_dir), **ENGINE_KW)


@pytest.mark.parametrize("sizes, says", [
    ({"hidden_size": 10**9}, "more than the .* GiB of memory available on cpu: refused before allocating"),
    ({"vocab_size": 10**12}, "more than the .* GiB of memory available"),
    ({"num_hidden_layers": 10**9}, "impossible sizes"),
    ({"intermediate_size": 10**10}, "the model's weights need at least"),  # only the exact count on meta sees it
])
def test_a_config_with_absurd_sizes_is_refused_before_allocating(llama, tmp_path, sizes, says) -> None:
    model_dir = shutil.copytree(llama, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **sizes}))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=says):
        Engine.from_pretrained(str(model_dir), **ENGINE_KW)
    assert time.monotonic() - start < 10
