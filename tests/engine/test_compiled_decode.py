"""The compiled decode step (torch.compile fullgraph, bucketed batch/KV length) gives the eager tokens."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from server.engine.engine import Engine
from server.engine.types import SamplingParams
from server.kernels import compat
from server.kernels.plan import step_plan
from tests.helpers import ENGINE_KW, random_ids, replan

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor needs a C compiler on the CPU")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_compiled_decode_matches_eager(arch, tiny_checkpoint):
    path, _ = tiny_checkpoint(arch)
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert compiled.runner.decode_graphs is not None
    prompts = [random_ids(n, n) for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == expected
    # Every shape compiled is a bucket (batch 1/2/4, KV blocks 4/8/16), so recompiles stay bounded.
    shapes = compiled.runner.decode_graphs.shapes_run
    assert shapes and all(b in (1, 2, 4) and n in (4, 8, 16) for b, n in shapes), shapes
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert compiled.generate(prompts[1], seeded).token_ids == eager.generate(prompts[1], seeded).token_ids
    # Launched kernel by kernel (no CUDA graphs), the step and the sampler were built with the C++ wrapper, whose
    # step traces its layers inline (it cannot call a compiled region: it would have failed to build).
    assert compiled.runner.decode_graphs.kernel_launch == "c++ wrapper" and compiled.runner._sample.cpp_wrapper
    # Greedy with a penalty, bias or logprobs is not the step's in-graph argmax: the sampler runs on its logits,
    # and the ids it picks are what the next step is fed.
    penalized = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=3.0, logprobs=2, ignore_eos=True)
    mixed = [penalized, params, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={7: 5.0}, ignore_eos=True)]
    want, got = ([e.inputs.make_request(p, m) for p, m in zip(prompts, mixed, strict=True)] for e in (eager, compiled))
    want, got = eager.run_to_completion(want), compiled.run_to_completion(got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].token_ids != expected[0][:8]  # the penalty did change the greedy picks
    for a, b in zip(got[0].logprobs, want[0].logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t.token_id for t in a.top] == [t.token_id for t in b.top]


@pytest.mark.compile
@pytest.mark.skipif(not compat.regions_compile_once(), reason="older torch traces every decoder layer inline")
@pytest.mark.parametrize("wrapper", ["python", "c++"])
def test_the_decoder_layer_region_is_traced_once_and_stamped_out_for_the_other_layers(wrapper, tiny_checkpoint,
                                                                                      monkeypatch):
    """Dynamo traces the layer region at its first call and reuses that trace for every other layer, which
    otherwise takes most of a warm start; the region's arguments are leaves, which dynamo fingerprints without
    tracing pytree's flatten at every call (where torch has that split). The C++ wrapper's step, which cannot
    call a region, gets them inlined after tracing (where torch has that pass)."""
    if wrapper == "c++" and not compat.regions_inline_after_tracing():
        pytest.skip("this torch traces the C++ wrapper's layers inline")
    from torch._dynamo.variables import invoke_subgraph

    flattened = []  # region calls whose arguments dynamo traced through pytree
    if hasattr(invoke_subgraph, "build_fingerprint_with_pytree"):
        flatten = invoke_subgraph.build_fingerprint_with_pytree
        monkeypatch.setattr(invoke_subgraph, "build_fingerprint_with_pytree",
                            lambda *args: flattened.append(1) or flatten(*args))
    reused = []
    handler = logging.Handler()
    handler.emit = lambda record: reused.append("cache hit" in record.getMessage())
    logger = logging.getLogger("torch._dynamo.variables.invoke_subgraph.__hierarchical_compile")
    path, _ = tiny_checkpoint("llama")
    engine = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    if wrapper == "python":
        engine.runner.decode_graphs.compiled.python_first()
    torch._logging.set_logs(hierarchical_compile=True)
    logger.addHandler(handler)
    try:
        engine.generate(random_ids(7, 7), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert sum(reused) == len(engine.model.model.layers) - 1 >= 1, reused
    assert not flattened
    assert engine.runner.decode_graphs.kernel_launch == f"{wrapper} wrapper"


@pytest.mark.compile
def test_batch1_graph_is_traced_apart_with_its_own_attention(tiny_checkpoint, monkeypatch):
    """The batch-1 decode graph is traced apart from larger batches (size 1 is static), so it can carry its own
    attention: with flex chosen, batch 1 has FlexAttention and no SDPA, batch 2 SDPA. Traced only: the CPU has no
    compiled flex-decoding kernel, which is the only form whose listed-blocks mask is right."""
    import torch

    traced = []  # (batch, SDPA in the graph, flex in the graph) per graph dynamo hands to the backend

    def backend(graph_module, example_inputs):
        packed = next(t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2)
        # the decoder layers are nested regions: their code is in submodules of the step's graph
        code = "\n".join(m.code for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule))
        traced.append((packed.shape[0], "scaled_dot_product_attention" in code, "flex_attention" in code))
        return graph_module.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": backend}))
    path, _ = tiny_checkpoint("llama")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    graphs = compiled.runner.decode_graphs
    assert graphs.step.flex_at_batch_1 is False  # chosen only on CUDA
    graphs.step.flex_at_batch_1 = True
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for prompts in ([random_ids(13, 4)], [random_ids(n, n) for n in (5, 9)]):
        compiled.generate(prompts, params)
    assert set(traced) == {(1, False, True), (2, True, False)}, traced


@pytest.mark.compile
def test_warm_up_compiles_every_later_decode_shape(tiny_checkpoint):
    """After warm_up(), other batch sizes and KV lengths reuse the compiled step: dynamo traces no new graph."""
    from torch._dynamo.utils import counters

    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert compiled.warm_up() > 0 and eager.warm_up() == 0.0
    graphs = compiled.runner.decode_graphs
    # without graphs (MPS, CPU) one run per batch bucket covers every KV length (symbolic block count)
    assert graphs.shapes_run == {(b, 4) for b in graphs.batch_sizes} and graphs.ready_num_seqs == graphs.batch_sizes[-1]
    assert graphs.warm(graphs.batch_sizes, 10**6) == 0
    assert not compiled.has_unfinished
    graphs_before = counters["stats"]["unique_graphs"]
    prompts = [random_ids(n, n + 40) for n in (40, 150, 7)]  # batch 3 (bucket 4), KV buckets 16 to 64 blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    for top_p in (1.0, 0.9):  # sampled requests: the sampler was compiled too
        params = SamplingParams(max_tokens=6, temperature=0.8, top_p=top_p, seed=5, ignore_eos=True)
        assert [o.token_ids for o in compiled.generate(prompts[:1], params)] == [
            o.token_ids for o in eager.generate(prompts[:1], params)]
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert (4, 64) in compiled.runner.decode_graphs.shapes_run  # a new batch and KV bucket, same compiled graph


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_compiled_prefill_matches_eager_and_warm_up_covers_its_shapes(arch, tiny_checkpoint):
    """compile_prefill: prefill, chunked and mixed steps through torch.compile(dynamic=True) give the eager
    tokens, and after warm_up() new prompt lengths and mixes trace no new graph (MoE layers pick their path by
    token count: warm-up runs each form with few and with many tokens)."""
    from torch._dynamo.utils import counters

    path, _ = tiny_checkpoint(arch)
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", compile_prefill=True)
    assert compiled.runner.forward_steps is not compiled.runner.model
    compiled.warm_up()
    graphs_before = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    for lens in [(5, 19, 11), (40, 3, 2, 27), (3,), (18,)]:  # fresh prompts together, chunks past the 16-token
        # budget, mixes; a short prompt alone; a chunk whose 2-token tail runs alone
        prompts = [random_ids(n, n + 7) for n in lens]
        want = [o.token_ids for o in eager.generate(prompts, params)]
        assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert counters["stats"]["unique_graphs"] == graphs_before


@pytest.mark.compile
def test_compiled_steps_match_eager_logprobs(tiny_checkpoint):
    """The compiled decode step and compiled prefill write K and V with one scatter into the
    [blocks, block, 2, heads, dim] cache and read them as views: the eager tokens and logprobs."""
    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", compile_prefill=True)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [random_ids(n, n + 3) for n in (6, 23, 2)]  # a chunk past the 16-token budget, decode at 3 positions
    expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert compiled.runner.decode_graphs.shapes_run  # the decode steps did run compiled
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    diffs = [abs(a.logprob - b.logprob) for o, e in zip(got, expected, strict=True) for a, b in zip(o.logprobs, e.logprobs, strict=True)]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("device, decode_compiled, hybrid, quantization, setting, expected", [
    ("cuda", True, False, None, None, True),  # the default where it was measured
    ("cuda", True, True, None, None, False),  # hybrids: minutes of cold compile, opt in
    ("cuda", True, False, "fp8", None, True),  # FP8 compiled prefill matched bf16 compiled
    ("cuda", False, False, None, None, False),  # compile=off keeps everything eager
    ("mps", True, False, None, None, False),  # not measured on a Mac yet
    ("cpu", True, True, None, True, True),  # an explicit setting wins
    ("cuda", True, False, None, False, False),
])
def test_compile_prefill_default(device, decode_compiled, hybrid, quantization, setting, expected):
    import torch

    from server.compile.policy import wants_compiled_prefill
    from server.config import EngineConfig

    config = EngineConfig.from_flat(compile_prefill=setting, quantization=quantization)
    assert wants_compiled_prefill(config, torch.device(device), decode_compiled, hybrid) is expected


def test_flex_at_batch_1_only_on_cuda_for_attention_only_models_where_its_probe_passes(monkeypatch):
    """The probe runs only where flex could be chosen; its verdict decides."""
    import torch

    from server.compile import decode_graphs

    probes = []
    verdict = [(True, "compiled and right")]
    monkeypatch.setattr(decode_graphs.flex_probe, "probe_compiled", lambda *a: probes.append(a) or verdict[0])
    cuda, cpu, mps = torch.device("cuda"), torch.device("cpu"), torch.device("mps")
    use_flex = decode_graphs.use_flex_at_batch_1
    assert use_flex(cuda, torch.bfloat16, 16, True) is True
    assert use_flex(cuda, torch.bfloat16, 16, False) is False  # hybrid
    assert use_flex(cpu, torch.float32, 16, True) is False
    assert use_flex(mps, torch.bfloat16, 16, True) is False
    assert probes == [("cuda", torch.bfloat16, 16)]
    verdict[0] = (False, "compiling it failed: RuntimeError: no kernel")
    assert use_flex(cuda, torch.bfloat16, 16, True) is False


def test_decode_shapes_to_prepare_are_bounded_by_the_cache(tiny_checkpoint):
    """Warm-up captures (CUDA graphs) every (batch, blocks) bucket whose KV gather fits the bound."""
    path, _ = tiny_checkpoint("llama")
    kw = {**ENGINE_KW, "max_num_seqs": 2, "max_model_len": 32}  # batches 1, 2 x blocks 4, 8 (block_size 4)
    graphs = Engine.from_pretrained(str(path), **kw, compile="on").runner.decode_graphs
    assert (graphs.batch_sizes, graphs.block_counts) == ([1, 2], [4, 8])
    assert graphs.buckets_within(8) == [(1, 4), (1, 8), (2, 4)]  # 2 x 8 blocks: past 8
    assert graphs.buckets_within(16) == [(1, 4), (1, 8), (2, 4), (2, 8)]


@pytest.mark.compile
def test_compiled_fp8_decode_reads_fp8_weights_and_matches_eager(tiny_checkpoint, monkeypatch):
    """FP8 llama, one request at a time, decode steps launched kernel by kernel (no CUDA graphs, as on MPS): the
    compiled batch-1 decode step reads each FP8 weight inside its reduction instead of quantizing the activation,
    although the CPU has row-wise scaled_mm; an eager engine made to compute the same form gives the same tokens."""
    from server.kernels import fp8

    path, _ = tiny_checkpoint("llama")
    prompts = [random_ids(n, n) for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with monkeypatch.context() as eager_patch:  # the same form eagerly, as the reference; prefill keeps scaled_mm
        replan(eager_patch, eager={"fp8_weight_only": True})
        eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off", quantization="fp8")
        expected = [eager.generate(p, params).token_ids for p in prompts]
    traced = []  # whether each activation quantization was traced into the compiled step
    quantize = fp8.quantize_activation
    monkeypatch.setattr(fp8, "quantize_activation",
                        lambda x, *args: traced.append(torch.compiler.is_compiling()) or quantize(x, *args))
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", quantization="fp8")
    assert [compiled.generate(p, params).token_ids for p in prompts] == expected
    assert compiled.runner.decode_graphs.shapes_run  # the decode steps did run compiled
    assert traced and not any(traced)  # the eager prefill quantized; the compiled decode step never did


def test_compiled_steps_raise_dynamos_recompile_limit_in_whichever_thread_calls_them():
    """torch's compile settings are per thread (2.13+): a limit set where the engine is built would not reach the
    background compile or the engine thread, where prefill's graphs compile."""
    import threading

    from server.compile.prefill import CompiledPrefill

    steps = CompiledPrefill(torch.nn.Identity(), [], step_plan("cpu", torch.float32, traced=True))
    seen = []
    steps._compiled = lambda *args: seen.append(torch._dynamo.config.recompile_limit)
    thread = threading.Thread(target=steps, args=(torch.zeros(1),))
    thread.start()
    thread.join()
    assert len(seen) == 1 and seen[0] >= 16


@pytest.mark.compile
def test_a_moe_whose_few_slots_threshold_is_two_sequences_compiles_every_batch(tmp_path, caplog):
    """16 experts, top-2: the gather-reduce test (4 x 2 x batch <= 16) holds at a batch of 2 and no more. As a guard
    on the symbolic batch it would leave it the single value 2 inside the compiled decoder layer, which the other
    layers' copies of the region cannot take (torch >= 2.13 fails the compile): the step must compile and give the
    eager tokens."""
    from tests.helpers import build_tiny

    build_tiny("qwen3_moe", tmp_path / "moe16", num_experts=16)
    prompts = [random_ids(n, n + int.from_bytes(os.urandom(2), "little")) for n in (5, 9, 7)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = Engine.from_pretrained(str(tmp_path / "moe16"), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(tmp_path / "moe16"), **ENGINE_KW, compile="on")
    with caplog.at_level(logging.WARNING):
        for batch in (prompts[:2], prompts):  # batch buckets 2 and 4
            assert [o.token_ids for o in compiled.generate(batch, params)] == [
                o.token_ids for o in eager.generate(batch, params)]
    assert compiled.compile_state != "failed" and "failed" not in caplog.text, caplog.text


@pytest.mark.compile
def test_compiled_decode_with_one_token_row_reductions_matches_eager(tiny_checkpoint, monkeypatch):
    """Llama's o_proj and down_proj as one-token row reductions in the batch-1 step (the form CUDA takes, forced
    here on the CPU): the eager tokens, and the step did trace the reductions."""
    from server.kernels import gemv

    path, hf_model = tiny_checkpoint("llama")
    prompts = [random_ids(n, n + int.from_bytes(os.urandom(2), "little")) for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    expected = [eager.generate(p, params).token_ids for p in prompts]
    traced = []  # the weight shapes of the row reductions dynamo traced (recorded at trace time, no guard on it)
    record = torch._dynamo.assume_constant_result(lambda rows, cols: traced.append((rows, cols)) or 0)
    reduction = gemv.row_reduction_linear
    replan(monkeypatch, compiled={"row_reduction_linear": True})
    monkeypatch.setattr(gemv, "row_reduction_linear", lambda x, w, b: reduction(x, w, b) + record(*w.shape))
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert [compiled.generate(p, params).token_ids for p in prompts] == expected
    config = hf_model.config
    q_size = config.num_attention_heads * config.head_dim
    assert set(traced) == {(config.hidden_size, q_size), (config.hidden_size, config.intermediate_size)}  # o, down


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_compiled_int4_decode_matches_eager(arch, tiny_checkpoint):
    """Quantized at load to int4: the compiled step reads the packed weights inside its reductions (linears at one
    token, the routed experts' rows), eager steps dequantize (the reference, and the experts' grouped form for a
    prompt); both give the same greedy tokens, one sequence and a batch."""
    path, _ = tiny_checkpoint(arch)
    eager, compiled = (Engine.from_pretrained(str(path), **ENGINE_KW, compile=mode, quantization="int4")
                       for mode in ("off", "on"))
    assert compiled.runner.decode_graphs is not None and compiled.bits_per_weight < 16  # of float32
    prompts = [random_ids(n, n + 1) for n in (21, 6, 13)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        expected = [o.token_ids for o in eager.generate(batch, params)]
        assert [o.token_ids for o in compiled.generate(batch, params)] == expected
