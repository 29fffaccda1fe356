"""The compiled decode step saved whole (saved_compile): a restart loads it and traces nothing, with the eager
tokens; an entry that does not load is traced again, a step that cannot be saved is compiled as before, and the
store's key separates what shapes the graphs."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from server.compile import saved as saved_compile
from server.compile import steps as compiled_steps
from server.compile import worker as compile_worker
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.engine.test_compile_child import compile_beside_serving, with_child  # noqa: F401 - a fixture
from tests.helpers import ENGINE_KW, needs_saved_compiles, random_ids

pytestmark = [pytest.mark.slow, pytest.mark.compile, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                   reason="inductor needs a C compiler on the CPU")]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAVED_STEPS_DIR = compile_worker.saved_steps_dir  # conftest's no_saved_compiles replaces it in each test


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Saving on, into a store of this test's own."""
    path = tmp_path / "saved-steps"
    monkeypatch.setattr(compiled_steps, "saved_steps_dir", lambda spec: path)
    return path


def fresh_prompts() -> list[list[int]]:
    seed = int.from_bytes(os.urandom(2), "little")
    return [random_ids(5, seed), random_ids(9, seed + 1)]  # batch 2: a symbolic batch size


def token_ids(engine: Engine, prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, PARAMS)]


def restart(path) -> tuple[Engine, dict]:
    """A compiled engine as a restart builds it, with dynamo's in-process caches emptied."""
    torch._dynamo.reset()
    counters.clear()
    return Engine.from_pretrained(str(path), **ENGINE_KW, compile="on"), counters["stats"]


@needs_saved_compiles
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_a_restart_loads_the_saved_decode_step_traces_nothing_and_gives_the_eager_tokens(
        arch, tiny_checkpoint, hybrid_checkpoint, store, caplog):
    path = tiny_checkpoint(arch)[0] if arch != "qwen3_next" else hybrid_checkpoint(arch)[0]
    prompts = fresh_prompts()
    expected = token_ids(Engine.from_pretrained(str(path), **ENGINE_KW, compile="off"), prompts)
    first, stats = restart(path)
    assert first.runner.decode_graphs.compiled.compiled.store is not None
    assert token_ids(first, prompts) == expected
    assert stats["unique_graphs"] >= 1
    saved = sorted(store.rglob("*.pt2"))
    assert saved  # one per traced entry
    with caplog.at_level(logging.INFO, logger="server.compile.saved"):
        restarted, stats = restart(path)
        assert token_ids(restarted, prompts) == expected
    assert stats.get("unique_graphs", 0) == 0  # dynamo traced nothing
    assert "loaded a saved compile of the decode step" in caplog.text
    assert sorted(store.rglob("*.pt2")) == saved


@needs_saved_compiles
def test_an_entry_that_does_not_load_is_traced_again_with_a_warning(tiny_checkpoint, store, caplog):
    path = tiny_checkpoint("llama")[0]
    prompts = fresh_prompts()
    expected = token_ids(Engine.from_pretrained(str(path), **ENGINE_KW, compile="on"), prompts)
    for entry in store.rglob("*.pt2"):
        entry.write_bytes(b"not what torch wrote")
    broken = set(store.rglob("*.pt2"))
    restarted, stats = restart(path)
    with caplog.at_level(logging.WARNING):
        assert token_ids(restarted, prompts) == expected
    assert "does not load" in caplog.text and "it is traced again" in caplog.text
    assert stats["unique_graphs"] >= 1
    now = set(store.rglob("*.pt2"))
    assert now and not now & broken  # the unreadable entries are gone, the new trace is saved


class _Unsaveable:
    calls = 0

    def __init__(self, fn, **compile_kwargs):
        pass

    def aot_compile(self, example_inputs):
        type(self).calls += 1
        raise RuntimeError("backend output does not implement SerializableCallable")


@needs_saved_compiles
def test_a_step_that_cannot_be_saved_is_compiled_as_before_with_one_warning(tiny_checkpoint, store, monkeypatch,
                                                                           caplog):
    monkeypatch.setattr(saved_compile, "_compile", _Unsaveable)
    path = tiny_checkpoint("llama")[0]
    prompts = fresh_prompts()
    expected = token_ids(Engine.from_pretrained(str(path), **ENGINE_KW, compile="off"), prompts)
    engine, stats = restart(path)
    with caplog.at_level(logging.WARNING):
        assert token_ids(engine, prompts) == expected
        assert token_ids(engine, prompts[:1]) == expected[:1]  # batch 1: another entry, no second warning
    assert caplog.text.count("to be saved for restarts failed") == 1
    assert stats["unique_graphs"] >= 2 and not list(store.rglob("*.pt2"))
    tried = _Unsaveable.calls
    caplog.clear()
    with caplog.at_level(logging.INFO):
        restarted, _ = restart(path)  # the failure is remembered: no second try, no second warning
        assert token_ids(restarted, prompts) == expected
    assert _Unsaveable.calls == tried and "saving it failed before" in caplog.text
    assert "to be saved for restarts failed" not in caplog.text


def test_the_store_is_keyed_on_what_shapes_the_graphs_and_not_on_the_kv_memory_setting(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint("llama")[0]), **ENGINE_KW, compile="on")
    spec = compile_worker.child_spec(engine.model, engine.config, engine.device, engine.dtype, engine.max_model_len,
                                     engine.kv_cache.num_blocks - 1)
    path = SAVED_STEPS_DIR(spec)
    cache = spec["config"]["cache"]
    config = dict(spec["config"], cache=dict(cache, kv_cache_memory_bytes=cache["kv_cache_memory_bytes"] * 2,
                                             kv_cache_memory_fraction=0.25))
    assert SAVED_STEPS_DIR(dict(spec, config=config, stages=["x"], save_steps=True)) == path
    fewer_seqs = dict(spec["config"], scheduler=dict(spec["config"]["scheduler"], max_num_seqs=3))
    for changed in (dict(dtype="bfloat16"), dict(torch_version="0.0"), dict(num_kv_blocks=spec["num_kv_blocks"] + 1),
                    dict(config=fewer_seqs), dict(device="cuda"), dict(source="other")):
        other = dict(spec, **changed)
        if other["device"] == "cuda" and not torch.cuda.is_available():
            continue  # the device's name is part of the key
        assert SAVED_STEPS_DIR(other) != path, changed


@needs_saved_compiles
@pytest.mark.usefixtures("with_child")
def test_the_compile_child_saves_the_decode_step_and_the_serving_process_only_loads_it(tiny_checkpoint, monkeypatch,
                                                                                      caplog):
    """The child traces the step on its fakes and saves it without running it; the serving process, once the child
    has filled a stage, loads it with the eager tokens (no trace of its own), and a restart needs no child."""
    for module in (compiled_steps, compile_worker):
        monkeypatch.setattr(module, "saved_steps_dir", SAVED_STEPS_DIR)
    path = tiny_checkpoint("qwen3_moe")[0]
    prompts = fresh_prompts()
    expected = token_ids(Engine.from_pretrained(str(path), **ENGINE_KW, compile="off"), prompts)
    for restarted in (False, True):
        caplog.clear()
        torch._dynamo.reset()
        meanwhile, compiled, _ = compile_beside_serving(path, prompts, caplog)
        assert meanwhile == expected and compiled == expected
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("loaded a saved compile of the decode step") for m in messages), messages
        assert not any(m.startswith("saved a compile of") for m in messages), "\n".join(m for m in messages if "compile" in m)
        assert any(m.startswith("the compile child filled") for m in messages) is not restarted


def test_where_torch_does_not_save_compiles_soundly_the_step_is_traced_at_each_start(tiny_checkpoint, store,
                                                                                     monkeypatch):
    monkeypatch.setattr(saved_compile, "saves_compiles", lambda: False)
    path = tiny_checkpoint("llama")[0]
    prompts = fresh_prompts()
    expected = token_ids(Engine.from_pretrained(str(path), **ENGINE_KW, compile="off"), prompts)
    engine, stats = restart(path)
    assert engine.runner.decode_graphs.compiled.compiled.store is None
    assert token_ids(engine, prompts) == expected and stats["unique_graphs"] >= 1
    assert not store.exists()
