"""The background compile's heavy half in a child process on fake tensors: it fills inductor's on-disk caches,
and the serving process then loads each stage as a cache hit, with the same tokens. A warm cache needs no child;
a child that fails only leaves the compile to the serving process."""

from __future__ import annotations

import json

import logging
import shutil

import pytest
import torch._dynamo
from torch._dynamo.utils import counters

import server.compile.steps
from server.compile import twin as compile_twin
from server.compile import worker as compile_worker
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from server.models.quant import quantizable_linears
from tests.helpers import ENGINE_KW, build_tiny, random_ids

pytestmark = [pytest.mark.compile, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                     reason="inductor needs a C compiler on the CPU")]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def with_child(monkeypatch, tmp_path):
    """The compile child on, in a cache directory of this test's own (the child inherits the environment)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(server.compile.steps, "start_compile_child", compile_worker.start_compile_child)
    keep_stages(monkeypatch, lambda what: "C++" not in what)  # minutes to build on the CPU


def keep_stages(monkeypatch, keep) -> None:
    """Only the warm-up stages `keep(what)` accepts; the child is not asked for the others either."""
    stages = server.compile.steps.warm_up_stages
    monkeypatch.setattr(server.compile.steps, "warm_up_stages",
                        lambda *args: [stage for stage in stages(*args) if keep(stage[0])])


def compile_beside_serving(path, prompts, caplog, **engine_kw) -> tuple[list[list[int]], list[list[int]], dict]:
    """Start as `serve` does (the child starts before the weights load) and serve `prompts` while compiling, then
    after it -> (tokens meanwhile, tokens compiled, inductor's counts of the compile)."""
    counters.clear()
    config = EngineConfig.from_flat(model=str(path), **{**ENGINE_KW, **engine_kw}, compile="on")
    engine = Engine.from_config(config, compile_beside_serving=True)
    with caplog.at_level(logging.INFO):
        background = engine.compile_in_background()
        meanwhile = [o.token_ids for o in engine.generate(prompts, PARAMS)]
        assert background.join(300) and engine.compile_state == "ready", background.error
    counts = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")}
    compiled = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    assert engine.runner.decode_graphs is not None
    return meanwhile, compiled, counts


def test_a_child_fills_the_cache_so_that_serving_only_loads_and_a_warm_restart_compiles_nothing(tiny_checkpoint,
                                                                                               with_child, caplog):
    """Also when the restart finds a little less free memory: the KV block count (in every graph's cache key) is
    planned in steps coarse enough to stay the same."""
    path, _ = tiny_checkpoint("qwen3_moe")
    prompts = [random_ids(n, n + 3) for n in (6, 11)]
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    expected = [o.token_ids for o in eager.generate(prompts, PARAMS)]
    block_bytes = sum(layer[0].numel() * layer.element_size() for layer in eager.kv_cache.layers)
    # 171 blocks, fewer than 8 sequences of max_model_len: the budget sets the count (170, a multiple of 2)
    kv_bytes = 171 * block_bytes
    meanwhile, compiled, counts = compile_beside_serving(path, prompts, caplog, kv_cache_memory_bytes=kv_bytes)
    assert meanwhile == expected and compiled == expected
    filled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the compile child filled")]
    assert len(filled) == 3, filled  # one sequence, the sampler, 2-8 sequences
    assert counts.get("fxgraph_cache_miss", 0) == 0 and counts["fxgraph_cache_hit"] >= 3, counts
    caplog.clear()
    torch._dynamo.reset()  # as a restart: no compiled code in memory
    meanwhile, compiled, counts = compile_beside_serving(path, prompts, caplog,
                                                         kv_cache_memory_bytes=kv_bytes - block_bytes)
    assert meanwhile == expected and compiled == expected
    assert not any("compile child filled" in r.getMessage() for r in caplog.records)
    assert counts.get("fxgraph_cache_miss", 0) == 0 and counts["fxgraph_cache_hit"] >= 3, counts


def test_a_child_that_fails_leaves_the_compile_to_the_serving_process(tiny_checkpoint, with_child, caplog,
                                                                     monkeypatch):
    path, _ = tiny_checkpoint("llama")
    keep_stages(monkeypatch, lambda what: what == "the decode step of one sequence")
    monkeypatch.setattr(server.compile.steps, "start_compile_child",  # a model the child cannot build
                        lambda spec, stages: compile_worker.start_compile_child(
                            {**spec, "hf_config": {"model_type": "no_such_model"}}, stages))
    prompts = [random_ids(7, 1)]
    expected = [o.token_ids for o in Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
                .generate(prompts, PARAMS)]
    meanwhile, compiled, counts = compile_beside_serving(path, prompts, caplog)
    assert meanwhile == expected and compiled == expected
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the compile child failed")]
    assert len(failed) == 1 and "no_such_model" in failed[0], failed
    assert counts["fxgraph_cache_miss"] >= 1  # compiled here
    assert not any(r.levelno >= logging.WARNING for r in caplog.records if r.name.startswith("server"))


@pytest.mark.parametrize("arch,quantization", [("qwen3", None), ("qwen3", "fp8"), ("qwen3", "int4"),
                                               ("qwen3_moe", "int8")])
def test_the_twin_has_the_models_shapes_and_ties_without_memory(tmp_path, arch, quantization):
    """Every parameter and buffer a fake of the real shape, dtype and stride (FP8 where the real one is: every
    quantizable linear; packed int4 / int8 in each module's own format, an MoE router's 8 bits among 4-bit
    experts); a tied LM head stays one tensor."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    build_tiny(arch, tmp_path, tie_word_embeddings=True)
    engine = Engine.from_pretrained(str(tmp_path), **ENGINE_KW, compile="on", quantization=quantization)
    real = engine.model
    spec = json.loads(json.dumps(compile_worker.child_spec(real, engine.config, engine.device, engine.dtype, 64, 8)))
    assert spec["fp8"] is (quantization == "fp8")
    assert (spec["affine_layout"] is not None) is (quantization in ("int4", "int8"))
    twin = compile_twin.fake_model(real.hf_config, engine.device, engine.dtype, FakeTensorMode(), spec["fp8"],
                                   spec["affine_layout"])
    real_tensors, twin_tensors = dict(real.state_dict(keep_vars=True)), dict(twin.state_dict(keep_vars=True))
    assert real_tensors.keys() == twin_tensors.keys()
    for name, tensor in real_tensors.items():
        fake = twin_tensors[name]
        assert isinstance(fake, FakeTensor), name
        assert (fake.shape, fake.stride(), fake.dtype, fake.device) == (tensor.shape, tensor.stride(), tensor.dtype,
                                                                       tensor.device), name
    assert real.lm_head.weight is real.model.embed_tokens.weight
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    if quantization == "fp8":
        assert not quantizable_linears(real)  # every projection in FP8: none stays in the model dtype


def test_a_child_is_asked_only_for_the_stages_the_cache_lacks(tiny_checkpoint, with_child, monkeypatch):
    """Each stage the child fills leaves a marker keyed by the engine's whole description; a start asks the child
    for the others only, and starts none when the cache holds them all (also before the engine exists, once a
    child's twin listed them). Prefill (whole requests) is never asked."""
    path, _ = tiny_checkpoint("llama")
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    started = []
    monkeypatch.setattr(compile_worker.CompileChild, "start", lambda spec, *args: started.append(spec) or "child")
    stages = ["the decode step of one sequence", "the sampler", "prefill"]
    assert compile_worker.start_compile_child(spec_of(engine), stages) == "child"
    spec = started.pop()
    assert spec["stages"] == stages[:2]
    marker = compile_worker.filled_marker(spec, stages[0])
    marker.parent.mkdir(parents=True)
    marker.write_text("filled")
    compile_worker.start_compile_child(spec_of(engine), stages)
    assert started.pop()["stages"] == stages[1:2]
    compile_worker.start_compile_child(spec_of(engine), None)  # before the engine exists: the child picks
    assert started.pop()["stages"] is None and compile_worker.stages_to_fill(spec, stages) == stages[1:2]
    compile_worker.filled_marker(spec, stages[1]).write_text("filled")
    assert compile_worker.start_compile_child(spec_of(engine), stages) is None
    compile_worker.start_compile_child(spec_of(engine), None)  # no twin listed its stages yet: one starts
    assert started.pop()["stages"] is None
    compile_twin.write_marker(spec, compile_worker.STAGE_LIST, stages)  # as a child's twin does
    assert compile_worker.start_compile_child(spec_of(engine), None) is None and not started
    other = Engine.from_pretrained(str(path), **{**ENGINE_KW, "max_num_seqs": 4}, compile="on")  # other graphs
    compile_worker.start_compile_child(spec_of(other), stages)
    assert started.pop()["stages"] == stages[:2]


def test_a_restart_whose_cache_holds_every_stage_builds_the_final_forms_from_the_first_stage(tiny_checkpoint,
                                                                                              with_child,
                                                                                              monkeypatch):
    """Beside serving, the steps launch from inductor's Python wrapper until a last stage has built the C++ form;
    where a child filled every stage of this engine before, each form only loads, so the stages build the C++
    form from the first one on, and no child starts."""
    path, _ = tiny_checkpoint("llama")
    asked, started = [], []  # warm_up_stages' `beside_serving` per compile_in_background; children started
    monkeypatch.setattr(server.compile.steps, "warm_up_stages",
                        lambda runner, blocks, prefill, beside_serving: asked.append(beside_serving) or [])
    monkeypatch.setattr(server.compile.steps, "start_compile_child",
                        lambda spec, stages: started.append(stages))
    for cached in (False, True):
        engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
        engine.compile_in_background().join(60)
        assert asked.pop() is not cached and len(started) == (not cached)
        started.clear()
        names = ["the decode step of one sequence", "the decode step and the sampler launched from C++"]
        for what in names:  # as a child that filled them leaves them
            compile_twin.write_marker(spec_of(engine), what, "filled")
        compile_twin.write_marker(spec_of(engine), compile_worker.STAGE_LIST, names)


def spec_of(engine) -> dict:
    return compile_worker.child_spec(engine.model, engine.config, engine.device, engine.dtype, engine.max_model_len,
                                     engine.kv_cache.num_blocks - 1)


def test_serve_starts_the_child_before_the_weights_load_and_the_compile_takes_it_over(tiny_checkpoint,
                                                                                      monkeypatch):
    """The child starts once the model's tensors exist, before any weight is read, for the KV block count the
    engine then holds; `compile_in_background` waits on that child. Where nothing compiles, no child starts."""
    from server.engine.weights import WeightLoader

    path, _ = tiny_checkpoint("llama")
    weights_read, started = [], []
    load = WeightLoader.load
    monkeypatch.setattr(WeightLoader, "load", lambda *args: weights_read.append(1) or load(*args))

    class Child:
        def want(self, stages):
            self.wanted = stages

        def wait_for(self, what):
            return False

        def loaded(self, what):
            pass

        def close(self):
            self.closed = True

    def start(spec, stages):
        started.append((spec, stages, len(weights_read)))
        return Child()

    monkeypatch.setattr(server.compile.steps, "start_compile_child", start)
    kw = dict(ENGINE_KW, kv_cache_memory_bytes=100_000)  # a budget-limited count
    engine = Engine.from_config(EngineConfig.from_flat(model=str(path), **kw, compile="on"), compile_beside_serving=True)
    (spec, stages, num_read), = started
    assert num_read == 0 and weights_read and stages is None
    assert spec["num_kv_blocks"] == engine.kv_cache.num_blocks - 1 == spec_of(engine)["num_kv_blocks"]
    background = engine.compile_in_background()
    assert isinstance(background._child, Child) and len(started) == 1
    assert background._child.wanted == [what for what, _ in background._stages]
    assert background.join(300) and engine.compile_state == "ready", background.error
    Engine.from_config(EngineConfig.from_flat(model=str(path), **kw, compile="off"), compile_beside_serving=True)
    assert len(started) == 1


def test_a_stage_the_child_was_not_asked_for_is_not_waited_for(tmp_path):
    """Not even before the child announced its stages (it builds its twin first: seconds on a GPU)."""
    import sys
    import time

    from server.compile.child import CompileChild

    child = CompileChild.start({"stages": ["the sampler"]}, [sys.executable, "-c", "import time; time.sleep(60)"],
                               {}, tmp_path / "child.log", lambda: 0)
    try:
        start = time.perf_counter()
        assert not child.wait_for("the decode step of one sequence")
        assert time.perf_counter() - start < 5
    finally:
        child.close()
