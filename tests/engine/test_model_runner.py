"""The model runner's step paths: what surrounds the forward of prefill and mixed steps."""

from __future__ import annotations

import contextlib

from server.engine import model_runner
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from tests.helpers import ENGINE_KW, random_ids


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
        return eager(*args)

    monkeypatch.setattr(model_runner, "prefill_sdpa_backends", recording)
    eager, engine.runner.forward_steps = engine.runner.eager_forward, forward
    engine.generate([random_ids(9, 1), random_ids(30, 2)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert forwards and all(forwards) and entered[0] == engine.device


def test_kv_cache_keeps_k_and_v_side_by_side_per_layer(tiny_checkpoint):
    """One [blocks, block, 2, kv_heads, dim] tensor per attention layer, sized from the model's KV shapes, plus
    the reserved null block."""
    path = str(tiny_checkpoint("llama")[0])
    engine = Engine.from_pretrained(path, **ENGINE_KW)
    cache = engine.kv_cache
    shapes = engine.model.kv_cache_shapes()
    assert len(cache.layers) == len(shapes)
    for layer, (kv_heads, head_dim) in zip(cache.layers, shapes, strict=True):
        assert layer.shape == (cache.num_blocks, ENGINE_KW["block_size"], 2, kv_heads, head_dim)
    assert cache.num_blocks == engine.kv_manager.num_usable_blocks + 1
