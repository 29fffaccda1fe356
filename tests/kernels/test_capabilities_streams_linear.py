"""The capability probe, the host-copy wrapper and the dense decode linear (CPU)."""

from __future__ import annotations

import shutil
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.config import EngineConfig
from server.kernels.capabilities import Capabilities, Probe, capabilities
from server.kernels.linear import ReductionGemv, linear, linear_reference, use_reduction_gemv
from server.kernels.streams import DeviceStreams


def test_probe_is_cached_and_describes_every_entry():
    caps = capabilities("cpu")
    assert caps is capabilities(torch.device("cpu"))
    probes = [f.name for f in fields(Capabilities) if isinstance(getattr(caps, f.name), Probe)]
    lines = caps.describe()
    assert lines[0].startswith("device cpu, torch ")
    assert len(lines) == 1 + len(probes)
    for name, line in zip(probes, lines[1:], strict=True):
        assert line.split()[0] == name and line.split()[1] in ("yes", "no")
        assert getattr(caps, name).reason  # a reason for every entry, pass or fail


def test_probe_answers_agree_with_running_the_ops():
    caps = capabilities("cpu")
    assert not caps.streams.ok  # cpu copies are synchronous
    assert caps.compile.ok == any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    offs = torch.tensor([2, 5], dtype=torch.int32)
    try:
        out = torch.nn.functional.grouped_mm(torch.randn(5, 16), torch.randn(2, 16, 8), offs=offs)
        works = bool(torch.isfinite(out).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        works = False
    assert caps.grouped_mm(torch.float32) == works
    assert caps.grouped_mm(torch.int8) is False
    assert caps.grouped_mm(torch.bfloat16, tracing=True) == (caps.grouped_mm_bf16.ok and caps.grouped_mm_bf16_traced.ok)


def test_host_copy_on_cpu_is_a_snapshot():
    streams = DeviceStreams("cpu")
    ids = torch.randint(0, 1000, (8,))
    pending = streams.copy_to_host(ids)
    expected = ids.clone()
    ids.add_(1)  # the next step reusing the buffer must not change what was copied
    assert pending.ready()
    assert torch.equal(pending.wait(), expected)


def test_decode_linear_fuses_bias_and_keeps_shape():
    x = torch.randn(3, 1, 64)
    weight, bias = torch.randn(40, 64), torch.randn(40)
    out = linear(x, weight, bias)
    assert out.shape == (3, 1, 40)
    torch.testing.assert_close(out, linear_reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    x16 = x.to(torch.bfloat16)
    out16 = linear(x16, weight.to(torch.bfloat16))
    ref = linear_reference(x16, weight.to(torch.bfloat16))
    assert ((out16.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_decode_gemv_choice_defaults_and_is_checked():
    assert EngineConfig().decode_gemv == "blas"  # on every device: reduction is an opt-in A/B knob
    assert EngineConfig(decode_gemv="reduction").decode_gemv == "reduction"
    with pytest.raises(ValueError, match="decode_gemv='gemm' is not one of blas, reduction"):
        EngineConfig(decode_gemv="gemm")
    for name, value, names in [("kv_layout", "paired", "split, combined"), ("decode_attention", "flash", "auto, sdpa, reduce, flex")]:
        with pytest.raises(ValueError, match=f"{name}='{value}' is not one of {names}"):
            EngineConfig(**{name: value})


def test_reduction_gemv_only_for_one_static_token_under_compile():
    """Linears with out <= in get the form; compiled with one token the graph has a multiply-and-sum and no
    linear, with several tokens (or eagerly) it is F.linear; values match F.linear in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 96, bias=False), nn.Linear(96, 96, bias=False))
    weights = [m.weight.detach().clone() for m in model]
    assert use_reduction_gemv(model) == ["0", "2"] and use_reduction_gemv(model) == []  # idempotent
    assert type(model[1]) is nn.Linear and isinstance(model[0], nn.Linear) and isinstance(model[2], ReductionGemv)
    assert all(torch.equal(m.weight, w) for m, w in zip(model, weights, strict=True))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method")])
        return gm.forward

    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, 1, 64)
        expected = F.linear(F.linear(F.linear(x, *weights[:1], model[0].bias), weights[1]), weights[2])
        torch._dynamo.reset()
        got = torch.compile(model, backend=capture, dynamic=False, fullgraph=True)(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # eager: F.linear itself
    one, three = graphs
    assert sum("linear" in t for t in one) == 1 and any("sum" in t for t in one)  # only model[1] stays a linear
    assert sum("linear" in t for t in three) == 3 and not any("sum" in t for t in three)
    torch._dynamo.reset()
    x = torch.randn(1, 1, 64)
    torch.testing.assert_close(torch.compile(model, dynamic=False)(x), model(x), rtol=1e-5, atol=1e-5)  # inductor


def test_reduction_gemv_stores_its_input_before_reducing():
    """The input's producer (here a cheap product, which inductor would inline) is stored as its own buffer before
    the reduction reads it, instead of being recomputed for every output row (what made the H200 step slower)."""
    from torch._inductor import metrics

    layer = nn.Linear(64, 32, bias=False)
    use_reduction_gemv(layer)
    a, b = torch.randn(1, 64), torch.randn(1, 64)
    torch._dynamo.reset()
    metrics.reset()
    # no_grad as the engine runs (with autograd on, the product is kept for backward anyway); no cache, so that
    # inductor lowers the graph here and counts its nodes
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(lambda a, b: layer(a * b), dynamic=False, fullgraph=True)(a, b)
    torch.testing.assert_close(got, F.linear(a * b, layer.weight), rtol=1e-5, atol=1e-5)
    assert metrics.ir_nodes_pre_fusion == 2  # the product, then the reduction
