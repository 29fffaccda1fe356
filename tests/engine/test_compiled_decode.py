"""The compiled decode step (torch.compile fullgraph, bucketed batch/KV length) gives the eager tokens."""

from __future__ import annotations

import shutil

import pytest

from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.models.test_parity import ENGINE_KW, random_ids

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor needs a C compiler on the CPU")


@pytest.mark.parametrize("arch, decode_attention", [("qwen3_moe", "sdpa"), ("llama", "reduce")])
def test_compiled_decode_matches_eager(arch, decode_attention, tiny_checkpoint):
    path, _ = tiny_checkpoint(arch)
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", decode_attention=decode_attention)
    assert compiled.runner.decode_graphs is not None
    prompts = [random_ids(n, n) for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == expected
    # Every shape compiled is a bucket (batch 1/2/4, KV blocks 4/8/16), so recompiles stay bounded.
    shapes = compiled.runner.decode_graphs._seen
    assert shapes and all(b in (1, 2, 4) and n in (4, 8, 16) for b, n in shapes), shapes
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert compiled.generate(prompts[1], seeded).token_ids == eager.generate(prompts[1], seeded).token_ids
    # Greedy with a penalty, bias or logprobs is not the step's in-graph argmax: the sampler runs on its logits,
    # and the ids it picks are what the next step is fed.
    penalized = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=3.0, logprobs=2, ignore_eos=True)
    mixed = [penalized, params, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={7: 5.0}, ignore_eos=True)]
    want, got = ([e.make_request(p, m) for p, m in zip(prompts, mixed, strict=True)] for e in (eager, compiled))
    want, got = eager._run_to_completion(want), compiled._run_to_completion(got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].token_ids != expected[0][:8]  # the penalty did change the greedy picks
    for a, b in zip(got[0].logprobs, want[0].logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_static_decode_shapes_compile_each_bucket_and_match_eager(tiny_checkpoint):
    """decode_static_shapes (the no-graph A/B knob): one graph per (batch, blocks) bucket, the eager tokens."""
    from torch._dynamo.utils import counters

    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", decode_static_shapes=True)
    prompts = [random_ids(n, n + 7) for n in (10, 3)]  # batch 2; the longer one crosses 16 tokens (4 blocks of 4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphs_before = counters["stats"]["unique_graphs"]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    seen = compiled.runner.decode_graphs._seen
    assert seen == {(2, 4), (2, 8)}
    assert counters["stats"]["unique_graphs"] - graphs_before == len(seen)  # symbolic sizes would share one graph


def test_reduction_gemv_decode_matches_eager(tiny_checkpoint):
    """decode_gemv="reduction" (an opt-in A/B knob) on the CPU: the batch-1 step's o_proj and down_proj as one
    reduction each give the eager tokens and logprobs (fp32); batch 2 keeps F.linear. Unknown names are refused."""
    from server.kernels.linear import ReductionGemv

    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", decode_gemv="reduction")
    swapped = {name.rsplit(".", 1)[-1] for name, m in compiled.model.named_modules() if isinstance(m, ReductionGemv)}
    assert swapped == {"o_proj", "down_proj"}  # qkv, gate_up and the LM head are wider than their input
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompts in ([random_ids(13, 4)], [random_ids(n, n) for n in (5, 9)]):
        expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        diffs = [abs(a.logprob - b.logprob) for o, e in zip(got, expected, strict=True) for a, b in zip(o.logprobs, e.logprobs, strict=True)]
        assert max(diffs) < 1e-4
    assert {b for b, _ in compiled.runner.decode_graphs._seen} == {1, 2}
    with pytest.raises(ValueError, match="decode_gemv='gemm' is not one of blas, reduction"):
        Engine.from_pretrained(str(path), **ENGINE_KW, decode_gemv="gemm")


def test_autotuned_batch1_decode_graph_matches_eager(tiny_checkpoint):
    """decode_autotune_batch1: batch 1 runs a second compiled callable (inductor GEMM autotuning), larger batches
    the usual one; both give the eager tokens (fp32)."""
    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", decode_autotune_batch1=True)
    graphs = compiled.runner.decode_graphs
    assert graphs.compiled_one is not graphs.compiled
    batches = {"one": [], "rest": []}

    def spy(name, fn):
        return lambda packed, ids: batches[name].append(packed.shape[0]) or fn(packed, ids)

    graphs.compiled_one, graphs.compiled = spy("one", graphs.compiled_one), spy("rest", graphs.compiled)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompts in ([random_ids(13, 4)], [random_ids(n, n) for n in (5, 9)]):
        want = [o.token_ids for o in eager.generate(prompts, params)]
        assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert set(batches["one"]) == {1} and set(batches["rest"]) == {2}


def test_batch1_decode_attention_is_chosen_apart(tiny_checkpoint, monkeypatch):
    """decode_attention "auto" gives the batch-1 graph its own attention (flex on CUDA, sdpa on the CPU): the batch-1
    step traces batch1_kernel, larger batches decode_kernel, and both give the eager tokens (fp32). On the CPU,
    where flex does not compile, "reduce" (no SDPA in the graph) stands in for it."""
    import torch

    traced = []  # (batch, SDPA in the graph) per graph dynamo hands to the backend

    def backend(graph_module, example_inputs):
        packed = next(t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2)
        traced.append((packed.shape[0], "scaled_dot_product_attention" in graph_module.code))
        return graph_module.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": backend}))
    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    graphs = compiled.runner.decode_graphs
    assert (graphs.batch1_kernel, graphs.decode_kernel) == ("sdpa", "sdpa")  # "auto" off CUDA
    graphs.batch1_kernel = "reduce"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompts in ([random_ids(13, 4)], [random_ids(n, n) for n in (5, 9)]):
        want = [o.token_ids for o in eager.generate(prompts, params)]
        assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert set(traced) == {(1, False), (2, True)}, traced


@pytest.mark.parametrize("kind, message", [("flash", "is not one of auto, sdpa, reduce, flex"),
                                           ("flex", "cannot run on cpu with torch .*; use 'sdpa'")])
def test_decode_attention_choice_is_checked(kind, message, tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", decode_attention=kind)


def test_warm_up_compiles_every_later_decode_shape(tiny_checkpoint):
    """After warm_up(), other batch sizes and KV lengths reuse the compiled step: dynamo traces no new graph."""
    from torch._dynamo.utils import counters

    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on")
    assert compiled.warm_up() > 0 and eager.warm_up() == 0.0
    assert {(1, 4), (2, 4)} <= compiled.runner.decode_graphs._seen
    assert not compiled.has_unfinished
    graphs_before = counters["stats"]["unique_graphs"]
    prompts = [random_ids(n, n + 40) for n in (40, 150, 7)]  # batch 3 (bucket 4), KV buckets 16 to 64 blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert (4, 64) in compiled.runner.decode_graphs._seen  # a new batch and KV bucket, same compiled graph


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


@pytest.mark.parametrize("decode_attention", ["sdpa", "reduce"])
def test_combined_kv_layout_compiled_matches_the_eager_split_layout(decode_attention, tiny_checkpoint):
    """kv_layout "combined" through the compiled decode step and compiled prefill: the eager split layout's tokens
    and logprobs (the write goes through one scatter into the [blocks, block, 2, heads, dim] tensor and every
    attention form reads K and V as views of it)."""
    path, _ = tiny_checkpoint("llama")
    eager = Engine.from_pretrained(str(path), **ENGINE_KW, compile="off", kv_layout="split")
    compiled = Engine.from_pretrained(str(path), **ENGINE_KW, compile="on", compile_prefill=True,
                                      decode_attention=decode_attention, kv_layout="combined")
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [random_ids(n, n + 3) for n in (6, 23, 2)]  # a chunk past the 16-token budget, decode at 3 positions
    expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert compiled.runner.decode_graphs._seen  # the decode steps did run compiled
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    diffs = [abs(a.logprob - b.logprob) for o, e in zip(got, expected, strict=True) for a, b in zip(o.logprobs, e.logprobs, strict=True)]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("device, decode_compiled, hybrid, quantization, setting, expected", [
    ("cuda", True, False, None, None, True),  # the default where it was measured
    ("cuda", True, True, None, None, False),  # hybrids: minutes of cold compile, opt in
    ("cuda", True, False, "fp8", None, False),  # FP8 prefill compiled: not measured yet
    ("cuda", True, False, "none", None, True),
    ("cuda", False, False, None, None, False),  # compile=off keeps everything eager
    ("mps", True, False, None, None, False),  # not measured on a Mac yet
    ("cpu", True, True, None, True, True),  # an explicit setting wins
    ("cuda", True, False, None, False, False),
])
def test_compile_prefill_default(device, decode_compiled, hybrid, quantization, setting, expected):
    import types

    import torch

    from server.config import EngineConfig

    engine = types.SimpleNamespace(
        config=EngineConfig(compile_prefill=setting, quantization=quantization), device=torch.device(device),
        runner=types.SimpleNamespace(decode_graphs=object() if decode_compiled else None),
        state_cache=object() if hybrid else None,
    )
    assert Engine._wants_compiled_prefill(engine) is expected


def test_auto_decode_attention_resolves_per_device_and_model(monkeypatch):
    """"auto": flex at batch 1 only on CUDA, for attention-only models, where the compiled probe passes (it is not
    run elsewhere); sdpa otherwise and for larger batches. A named kind applies to every batch."""
    import torch

    from server.engine import decode_graphs

    probes = []
    verdict = [(True, "compiled and right")]
    monkeypatch.setattr(decode_graphs.flex_decode, "probe_compiled", lambda *a: probes.append(a) or verdict[0])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    resolve = decode_graphs.resolve_decode_attention
    assert resolve("auto", cuda, torch.bfloat16, 16, True) == ("flex", "sdpa")
    assert resolve("auto", cuda, torch.bfloat16, 16, False) == ("sdpa", "sdpa")  # hybrid: not measured with flex
    assert resolve("auto", cpu, torch.float32, 16, True) == ("sdpa", "sdpa")
    assert probes == [("cuda", torch.bfloat16, 16)]
    assert resolve("reduce", cpu, torch.float32, 16, True) == ("reduce", "reduce")
    assert resolve("flex", cuda, torch.bfloat16, 16, False) == ("flex", "flex")
    verdict[0] = (False, "compiling it failed: RuntimeError: no kernel")
    assert resolve("auto", cuda, torch.bfloat16, 16, True) == ("sdpa", "sdpa")
    with pytest.raises(ValueError, match="decode_attention='flex' cannot run on cuda .*no kernel; use 'sdpa'"):
        resolve("flex", cuda, torch.bfloat16, 16, True)


def test_decode_shapes_prepared_before_serving(tiny_checkpoint):
    """prepare_shapes compiles (static shapes; on CUDA: captures) every (batch, blocks) bucket whose KV gather fits
    the bound, with padding rows only; later steps of those shapes trace nothing new and give the eager tokens, and
    warm_up prepares up to the KV cache's size."""
    from torch._dynamo.utils import counters

    path, _ = tiny_checkpoint("llama")
    kw = {**ENGINE_KW, "max_num_seqs": 2, "max_model_len": 32}  # batches 1, 2 x blocks 4, 8 (block_size 4)
    eager = Engine.from_pretrained(str(path), **kw, compile="off")
    compiled = Engine.from_pretrained(str(path), **kw, compile="on", decode_static_shapes=True)
    graphs = compiled.runner.decode_graphs
    assert (graphs.batch_sizes, graphs.block_counts) == ([1, 2], [4, 8])
    assert graphs.prepare_shapes(8) == 3 and graphs._seen == {(1, 4), (1, 8), (2, 4)}  # 2 x 8 blocks: past 8
    graphs_before = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompts in ([random_ids(20, 1)], [random_ids(n, n) for n in (3, 6)]):  # 1 x 8 blocks, then 2 x 4
        assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] == graphs_before and len(graphs._seen) == 3
    assert compiled.allocator.num_usable >= 16 and compiled.warm_up() > 0
    assert graphs._seen == {(1, 4), (1, 8), (2, 4), (2, 8)} and not compiled.has_unfinished
    symbolic = Engine.from_pretrained(str(path), **kw, compile="on")  # no graphs, symbolic sizes: as on MPS
    assert symbolic.runner.decode_graphs.prepare_shapes(10**6) == 0 and not symbolic.runner.decode_graphs._seen
