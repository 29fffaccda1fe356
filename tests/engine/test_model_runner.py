"""The model runner's step paths: what surrounds the forward of prefill and mixed steps."""

from __future__ import annotations

import contextlib

import pytest

from server.engine import model_runner
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.models.test_parity import ENGINE_KW, random_ids


def test_the_runner_runs_prefill_and_mixed_steps_in_the_prefill_context(tiny_checkpoint, monkeypatch):
    """Every forward outside the compiled decode step runs inside prefill_sdpa_backends(the engine's device)."""
    engine = Engine.from_pretrained(str(tiny_checkpoint("llama")[0]), **ENGINE_KW)
    entered, forwards = [], []

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        yield
        entered.append(None)

    def forward(*args):
        forwards.append(len(entered) % 2 == 1)  # inside an open context
        return engine.model(*args)

    monkeypatch.setattr(model_runner, "prefill_sdpa_backends", recording)
    engine.runner.forward_steps = forward
    engine.generate([random_ids(9, 1), random_ids(30, 2)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert forwards and all(forwards) and entered[0] == engine.device


def test_kv_cache_layouts_and_an_unknown_one(tiny_checkpoint):
    """split: a (K, V) pair per layer; combined: one [blocks, block, 2, kv_heads, dim] tensor per layer, the same
    bytes; anything else is refused by name."""
    path = str(tiny_checkpoint("llama")[0])
    split = Engine.from_pretrained(path, **ENGINE_KW, kv_layout="split").kv_cache
    combined = Engine.from_pretrained(path, **ENGINE_KW).kv_cache  # the default
    k_cache, v_cache = split.layers[0]
    assert combined.layers[0].shape == (k_cache.shape[0], k_cache.shape[1], 2, *k_cache.shape[2:])
    assert len(split.tensors()) == 2 * len(combined.tensors()) == 2 * len(combined.layers)
    assert sum(t.numel() for t in split.tensors()) == sum(t.numel() for t in combined.tensors())
    with pytest.raises(ValueError, match="kv_layout='paired' is not one of split, combined"):
        Engine.from_pretrained(path, **ENGINE_KW, kv_layout="paired")
