"""The capability probe and the host-copy wrapper (CPU)."""

from __future__ import annotations

import shutil
from dataclasses import fields

import torch

from server.kernels.capabilities import Capabilities, Probe, capabilities
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
    assert torch.equal(pending.wait(), expected)
