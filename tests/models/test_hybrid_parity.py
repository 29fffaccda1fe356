"""Hybrid architectures (LFM2 short-conv, Qwen3.5 / Qwen3-Next Gated DeltaNet) against transformers on tiny
random-weight checkpoints (fp32, CPU), and the engine's per-sequence state: chunked prefill, batched decode,
preemption, abort and prefix reuse of a conversation."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.engine.model_runner import KVCache
from server.engine.state_cache import StateSlots
from server.engine.types import SamplingParams
from server.kernels import compat
from server.models import regions
from tests.helpers import hf_greedy, make_engine, random_ids
from tests.kernels.sync_guard import assert_no_host_sync

ARCHS = ["lfm2", "lfm2_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_next_wide_shared"]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_over_gdn_chunks(arch, hybrid_checkpoint):
    path, hf_model = hybrid_checkpoint(arch)
    ids = random_ids(150, seed=3)  # more than two 64-token GDN chunks
    ref = hf_logits(hf_model, ids)
    for budget in (16, 256):  # ten prefill steps carrying the states, then the whole prompt in one step
        ours = make_engine(path, max_num_batched_tokens=budget).score(ids)
        assert ours.shape == ref.shape == (150, 256)
        assert (ours - ref).abs().max().item() < 1e-4, budget


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate_and_cached_decode_matches_full_forward(arch, hybrid_checkpoint):
    path, hf_model = hybrid_checkpoint(arch)
    engine = make_engine(path)
    ids = random_ids(37, seed=7)
    out = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0))
    assert out.token_ids == hf_greedy(hf_model, ids, 24)
    # Each decoded token's logprob (prefill + 23 cached decode steps) against one full forward of the text.
    full = torch.log_softmax(engine.score(ids + out.token_ids[:-1]), dim=-1)[len(ids) - 1 :]
    chosen = full.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    decoded = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (chosen - decoded).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_5_moe_text", "qwen3_next"])
def test_batch_of_different_lengths_gives_each_single_result(arch, hybrid_checkpoint):
    path, _ = hybrid_checkpoint(arch)
    engine = make_engine(path, enable_prefix_caching=False)
    prompts = [random_ids(n, seed=n) for n in (3, 17, 70, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    batched = engine.generate(prompts, params)  # prefill rows and decode rows share steps
    for prompt, out in zip(prompts, batched, strict=True):
        single = engine.generate(prompt, params)
        assert out.token_ids == single.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, single.logprobs, strict=True)) < 1e-4


def _rewrite_checkpoint(src: Path, dst: Path, prefix: str, nest_text_config: str | None) -> None:
    """Fused experts (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`), the text weights
    under `prefix`, vision / MTP tensors beside them and, optionally, the config nested as the VLM writes it."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[: i + 1]), {}).setdefault(int(parts[i + 1]), {})[parts[i + 2]] = t
        else:
            out[name] = t
    for base, per_expert in experts.items():
        gate, up, down = ("w1", "w3", "w2") if "w1" in per_expert[0] else ("gate_proj", "up_proj", "down_proj")
        ids = sorted(per_expert)
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per_expert[e][gate], per_expert[e][up]]) for e in ids])
        out[f"{base}.down_proj"] = torch.stack([per_expert[e][down] for e in ids])
    out = {(prefix + n[len("model."):] if n.startswith("model.") else n): t.contiguous() for n, t in out.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    out["mtp.layers.0.mlp.gate.weight"] = torch.zeros(2, 4)
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if nest_text_config:
        config = {"model_type": nest_text_config, "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "tie_word_embeddings": False, "text_config": config, "vision_config": {"depth": 1}}
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


@pytest.mark.parametrize(
    ("arch", "prefix", "nested"),
    [("qwen3_5_moe_text", "model.language_model.", "qwen3_5_moe"), ("lfm2_moe", "model.", None)],
)
def test_fused_experts_and_language_model_prefix_load(arch, prefix, nested, hybrid_checkpoint, tmp_path):
    path, hf_model = hybrid_checkpoint(arch)
    fused = tmp_path / "fused"
    _rewrite_checkpoint(path, fused, prefix, nested)
    ids = random_ids(40, seed=5)
    ours = make_engine(fused).score(ids)
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() < 1e-4


def test_fused_and_per_expert_checkpoints_quantize_to_the_same_fp8_experts(hybrid_checkpoint, tmp_path):
    """Qwen3.5-MoE's routed experts stored fused fill all but the experts' last slot (the shared expert's, from
    its own tensors): quantized to FP8 while loading, the same bytes and scales as from per-expert tensors."""
    path, _ = hybrid_checkpoint("qwen3_5_moe_text")
    fused = tmp_path / "fused"
    _rewrite_checkpoint(path, fused, "model.language_model.", "qwen3_5_moe")
    per_expert, from_fused = (make_engine(p, quantization="fp8").model.model.layers[1].mlp.experts for p in (path, fused))
    assert from_fused.shared_slot == from_fused.num_experts - 1
    for name in ("gate_up_proj", "gate_up_scale", "down_proj", "down_scale"):
        a, b = getattr(per_expert, name), getattr(from_fused, name)
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name


@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_5_moe_text", "qwen3_next"])
def test_conversation_reuses_state_and_matches_cold_run(arch, hybrid_checkpoint):
    path, _ = hybrid_checkpoint(arch)
    warm, cold = make_engine(path), make_engine(path, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)

    def assert_same_as_cold(out, prompt):
        ref = cold.generate(prompt, params)
        assert out.token_ids == ref.token_ids
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref.logprobs, strict=True)]
        assert max(diffs) < 1e-4

    prompt = random_ids(30, seed=21)
    for turn in range(3):
        out = warm.generate(prompt, params)
        assert_same_as_cold(out, prompt)
        if turn:  # the previous turns' states come from a snapshot, their KV from the prefix cache
            assert out.cached_tokens >= len(prompt) - 20
        prompt = prompt + out.token_ids + random_ids(7, seed=22 + turn)  # the next user message
    # Without its state snapshot a hybrid must not take the KV prefix hit: it recomputes from 0.
    warm.scheduler.state_slots.slot_of_hash.clear()
    out = warm.generate(prompt, params)
    assert out.cached_tokens == 0
    assert_same_as_cold(out, prompt)


@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_5_moe_text"])
def test_engine_steps_never_sync_with_the_host(arch, hybrid_checkpoint):
    """Prefill chunks, state resets / snapshot copies and batched decode: no .item(), nonzero or mask indexing."""
    path, _ = hybrid_checkpoint(arch)
    engine = make_engine(path)
    for n in (30, 7):
        engine.add_request(engine.inputs.make_request(random_ids(n, seed=n), copy.copy(GREEDY)))
    with assert_no_host_sync():
        while engine.has_unfinished:
            engine.step()


def test_preemption_and_abort_return_state_slots(hybrid_checkpoint):
    path, _ = hybrid_checkpoint("qwen3_5_text")
    probe = make_engine(path, enable_prefix_caching=False)
    per_block = KVCache.bytes_per_block(probe.model.kv_cache_shapes(), 4, torch.float32)
    # 4 requests of 60 tokens need 60 blocks; 24 fit, so running requests get preempted and recomputed.
    engine = make_engine(path, enable_prefix_caching=False, kv_cache_memory_bytes=24 * per_block)  # KV only
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [random_ids(40, seed=30 + i) for i in range(4)]
    requests = [engine.inputs.make_request(p, copy.copy(params)) for p in prompts]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished:
        engine.step()
    assert any(r.num_preemptions for r in requests)
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.output_token_ids == probe.generate(prompt, params).token_ids
    aborted = engine.inputs.make_request(prompts[0], copy.copy(params))
    engine.add_request(aborted)
    for _ in range(3):
        engine.step()
    engine.abort(aborted.request_id)
    while engine.has_unfinished:
        engine.step()
    slots = engine.scheduler.state_slots
    assert sorted(slots.free_live) == list(range(slots.num_live)) and aborted.state_slot is None


def test_state_slots_snapshot_bookkeeping():
    slots = StateSlots(num_live=2, num_snapshots=2, block_size=4)
    h = [bytes([i]) * 16 for i in range(6)]

    def save(request_id, num_hashes, start):  # plan a step, then launch it
        restore, slot = slots.plan(request_id, h[:num_hashes], start)
        if slot is not None:
            slots.publish(slot)
        return restore, slot

    live = slots.admit()
    assert save("a", 1, 0) == (None, None)  # position 0: reset, nothing to save
    assert save("a", 1, 3) == (None, None)  # not a block boundary
    _, first = save("a", 2, 8)  # boundary after block 2: saved under its hash
    _, rolled = save("a", 3, 12)
    assert first == rolled and slots.slot_of_hash == {h[2]: rolled}  # one rolling snapshot per sequence
    slots.release("a", live)
    assert slots.match("b", h[:5]) == 3 and save("b", 3, 12) == (rolled, None)
    assert slots.match("c", h[:2]) == 0  # no snapshot ends there: no prefix reuse at all
    # Pinned (a restore still to run) snapshots are never overwritten or evicted.
    assert slots.match("d", h[:3]) == 3
    _, other = save("e", 5, 20)
    _, none_left = save("f", 6, 24)
    assert other != rolled and none_left is None
    slots.release("d", None)  # the restore was dropped: the snapshot becomes evictable
    _, evicted = save("f", 6, 24)
    assert evicted == rolled and h[2] not in slots.slot_of_hash and slots.slot_of_hash[h[5]] == evicted


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C compiler")
def test_compiled_decode_step_matches_eager(hybrid_checkpoint):
    """The bucketed compiled decode step takes the rows' state slots; the padded 4th row uses the scratch slot."""
    path, _ = hybrid_checkpoint("qwen3_5_moe_text")
    kw = dict(max_num_batched_tokens=64)  # one prefill step, then every decode step has the same 3 rows: one compile
    eager, compiled = make_engine(path, compile="off", **kw), make_engine(path, compile="on", **kw)
    prompts = [random_ids(n, seed=n) for n in (5, 19, 11)]  # decode rows at different positions
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert compiled.runner.decode_graphs.shapes_run  # the decode steps did run compiled
    diffs = [abs(a.logprob - b.logprob) for o, e in zip(got, expected, strict=True) for a, b in zip(o.logprobs, e.logprobs, strict=True)]
    assert max(diffs) < 1e-4


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.timeout(1800)  # ~7-11 min with an empty inductor cache on a 2-core CI machine (its compiles)
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C compiler")
def test_compiled_prefill_matches_eager_and_warm_up_covers_its_shapes(hybrid_checkpoint):
    """compile_prefill on a hybrid: prompts of one and several 64-token GDN chunks, a prompt past the token budget
    (its tail runs as a one-row continued chunk, which once failed to lower in inductor) and fresh prompts mixed
    with a continued chunk give the eager tokens and logprobs, and after warm_up() none of them traces a graph."""
    from torch._dynamo.utils import counters

    path, _ = hybrid_checkpoint("qwen3_5_moe_text")
    kw = dict(max_num_batched_tokens=128)  # 2 GDN chunks per step at most
    eager = make_engine(path, compile="off", **kw)
    compiled = make_engine(path, compile="on", compile_prefill=True, **kw)
    assert compiled.runner.forward_steps is not compiled.runner.model
    compiled.warm_up()
    graphs_before = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    for lens in [(150,), (70,), (5, 19, 11), (100, 3)]:
        prompts = [random_ids(n, seed=n + 1) for n in lens]
        expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        diffs = [abs(a.logprob - b.logprob) for o, e in zip(got, expected, strict=True)
                 for a, b in zip(o.logprobs, e.logprobs, strict=True)]
        assert max(diffs) < 1e-4
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_state_snapshot_is_published_only_once_its_copy_is_launched():
    slots = StateSlots(num_live=1, num_snapshots=1, block_size=4)
    h = [bytes([i]) * 16 for i in range(3)]
    live = slots.admit()
    _, planned = slots.plan("a", h[:1], 4)
    assert planned is not None and slots.match("b", h[:1]) == 0  # the step was not launched yet
    slots.release("a", live)  # e.g. the request stopped and its step was dropped: nothing was copied
    assert slots.match("b", h[:1]) == 0 and slots.free_snapshots == [planned]  # the slot is not leaked
    live = slots.admit()
    _, planned = slots.plan("c", h[:2], 8)
    slots.publish(planned)
    slots.release("c", live)
    assert slots.match("d", h[:3]) == 2


@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_5_moe_text"])
def test_only_layers_compiled_as_regions_fuse_their_routers_top_k(arch, hybrid_checkpoint, monkeypatch):
    """Gated DeltaNet layers (a graph break in the chunked prefill) compile inline in prefill, where a fused top-k
    would be generated per layer; in the decode step (no break) every layer is a region, and fuses it. A step whose
    layers are inlined (the C++ wrapper's) calls regions traced once where torch inlines them after tracing, with
    the per-layer top-k; an eager step calls every layer as is."""
    path, _ = hybrid_checkpoint(arch)
    engine = make_engine(path)
    plans = engine.runner.plans
    traces_whole = [layer.traces_whole for layer in engine.model.model.layers]
    assert set(traces_whole) == ({True} if arch == "lfm2_moe" else {True, False})
    paths = []  # how each decoder layer runs: as a region (compiled once for all layers) or inline, fused or not
    monkeypatch.setattr(regions, "_call_region", lambda *args: paths.append(("region", args[-1].fused_top_k)))

    class Layer:
        def __init__(self, whole: bool):
            self.traces_whole = whole

        def __call__(self, x, rope, meta, cache, plan):
            paths.append(("inline", plan.fused_top_k))

    inlined = ("region", False) if compat.regions_inline_after_tracing() else ("inline", False)
    for plan, is_decode, expected in (
            (plans.compiled, False, [("region", True) if whole else ("inline", False) for whole in traces_whole]),
            (plans.compiled, True, [("region", True)] * len(traces_whole)),  # no graph break in a decode step
            (plans.compiled_layers_inline, True, [inlined] * len(traces_whole)),
            (plans.eager, False, [("inline", False)] * len(traces_whole))):
        paths.clear()
        for whole in traces_whole:
            regions.call_layer_region(Layer(whole), None, None, SimpleNamespace(is_decode=is_decode), None, plan)
        assert paths == expected
