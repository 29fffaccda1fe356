"""RoPE scaling types against transformers on tiny random-weight checkpoints (fp32, CPU), with prompts past
original_max_position_embeddings so the scaling matters; and the configs that refuse to load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import ModelLoadError, SamplingParams
from server.engine.weights import load_model
from server.models.layers import RotaryEmbedding
from server.models.llama import ModelArgs
from tests.helpers import ENGINE_KW, build_tiny, hf_greedy, make_engine, random_ids
from tests.kernels.sync_guard import assert_no_host_sync

ORIG_LEN = 64  # original_max_position_embeddings of the scaled configs
PROMPT_LEN = 100  # past ORIG_LEN
THETA = 1e4
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIG_LEN),
    "yarn_explicit": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIG_LEN,
                          attention_factor=0.8, beta_fast=16.0, beta_slow=2.0, truncate=False),
    "yarn_mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIG_LEN, mscale=1.0,
                        mscale_all_dim=0.5),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIG_LEN),
}
# dynamic NTK scales beyond max_position_embeddings rather than ORIG_LEN
ROPES = {**SCALINGS, "default": dict(rope_type="default"), "dynamic": dict(rope_type="dynamic", factor=4.0)}


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory):
    """Factory: (arch, scaling name) -> (path, hf_model), cached per module. Every checkpoint of one arch
    holds the same weights: only the rope settings differ."""
    cache: dict = {}

    def make(arch: str, scaling: str):
        if (arch, scaling) not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{scaling}")
            rope = dict(ROPES[scaling], rope_theta=THETA)
            cache[arch, scaling] = (path, build_tiny(arch, path, rope_parameters=rope))
        return cache[arch, scaling]

    return make


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch, scaling", [("llama", name) for name in SCALINGS] + [("qwen3", "yarn")])
def test_scaled_logits_match_transformers(arch, scaling, scaled_checkpoint):
    path, hf_model = scaled_checkpoint(arch, scaling)
    ids = random_ids(PROMPT_LEN, seed=len(scaling))
    ours = make_engine(path).score(ids)  # prefill chunks of 16 tokens
    ref = hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (PROMPT_LEN, 256)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("scaling", SCALINGS)
def test_each_scaling_changes_the_logits(scaling, scaled_checkpoint):
    """Against default RoPE on the same weights, so the parity above cannot pass with the scaling ignored."""
    ids = random_ids(PROMPT_LEN, seed=3)
    scaled = make_engine(scaled_checkpoint("llama", scaling)[0]).score(ids)
    plain = make_engine(scaled_checkpoint("llama", "default")[0]).score(ids)
    assert (scaled - plain).abs().max().item() > 0.05


def past_max_position(tmp_path, scaling: str, **kw) -> tuple[Engine, torch.nn.Module]:
    """A checkpoint with max_position_embeddings ORIG_LEN (where dynamic NTK starts to scale) and the engine
    serving it past that: from_pretrained caps max_model_len at max_position_embeddings, from_model does not.
    No prefix caching: a cache hit would reuse keys rotated for another length."""
    path = tmp_path / scaling
    hf_model = build_tiny("llama", path, max_position_embeddings=ORIG_LEN,
                          rope_parameters=dict(ROPES[scaling], rope_theta=THETA))
    model, _ = load_model(path, torch.device("cpu"), torch.float32)
    config = EngineConfig.from_flat(**{**ENGINE_KW, "enable_prefix_caching": False, **kw})
    return Engine.from_model(model, config, torch.device("cpu"), max_model_len=4 * ORIG_LEN), hf_model


def test_dynamic_ntk_matches_transformers_over_a_prompt_past_its_threshold(tmp_path):
    # one prefill step holds the whole prompt, as transformers' forward does
    dynamic, hf_model = past_max_position(tmp_path, "dynamic", max_num_batched_tokens=128)
    plain, _ = past_max_position(tmp_path, "default", max_num_batched_tokens=128)
    ids = random_ids(PROMPT_LEN, seed=5)
    ours = dynamic.score(ids)
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() < 1e-4
    assert (ours - plain.score(ids)).abs().max().item() > 0.05
    within = ids[:ORIG_LEN]  # up to the threshold it is default RoPE, bit for bit
    assert torch.equal(dynamic.score(within), plain.score(within))


def test_dynamic_ntk_decode_across_the_threshold_matches_transformers_generate(tmp_path):
    """Each decode step scales by its own length, as transformers' generate does."""
    engine, hf_model = past_max_position(tmp_path, "dynamic")
    ids = random_ids(ORIG_LEN - 10, seed=9)
    out = engine.generate(ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf_model, ids, 30)


def test_dynamic_ntk_frequencies_need_no_host_sync():
    rope = ModelArgs.from_hf_config(dict(max_position_embeddings=ORIG_LEN, rope_parameters=dict(
        rope_type="dynamic", factor=4.0, rope_theta=THETA))).rope_parameters
    rotary = RotaryEmbedding(16, rope)
    positions = torch.arange(3 * ORIG_LEN)
    with assert_no_host_sync():
        cos, sin = rotary(positions, torch.float32)
    plain_cos, _ = RotaryEmbedding(16, dict(rope_type="default", rope_theta=THETA))(positions, torch.float32)
    assert torch.equal(cos[:, :1], plain_cos[:, :1])  # the highest frequency keeps its angle
    assert (cos - plain_cos).abs().max().item() > 0.5


def test_legacy_rope_scaling_reads_as_rope_parameters():
    legacy = ModelArgs.from_hf_config(dict(rope_theta=THETA, max_position_embeddings=512, rope_scaling=dict(
        type="yarn", factor=8.0, original_max_position_embeddings=ORIG_LEN)))
    assert legacy.rope_parameters == dict(rope_type="yarn", rope_theta=THETA, factor=8.0,
                                          original_max_position_embeddings=ORIG_LEN)


def with_config(tiny_checkpoint, tmp_path, arch: str, **changes):
    """A copy of the tiny `arch` checkpoint with config.json keys changed (None deletes)."""
    path = tmp_path / arch
    shutil.copytree(tiny_checkpoint(arch)[0], path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


@pytest.mark.parametrize("arch, changes, message", [
    ("llama", dict(rope_parameters=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                        original_max_position_embeddings=ORIG_LEN)),
     r"rope_type 'longrope' is not supported; supported: default, linear, dynamic, yarn, llama3"),
    ("llama", dict(rope_parameters=None, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
     "rope_type 'mrope' is not supported"),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, alpha=2.0)),
     r"rope_parameters \['alpha'\] are not supported with rope_type 'yarn'"),
    ("llama", dict(rope_parameters=dict(rope_type="default", factor=4.0)),
     r"rope_parameters \['factor'\] are not supported with rope_type 'default'"),
    ("llama", dict(rope_parameters=dict(rope_type="linear")), r"rope_type 'linear' needs rope_parameters \['factor'\]"),
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=ORIG_LEN)),
     "scales beyond max_position_embeddings=512, not original_max_position_embeddings=64"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=32), r"sliding-window attention \(sliding_window=32\)"),
    ("llama", dict(sliding_window=32), r"sliding-window attention \(sliding_window=32\) is not supported"),
])
def test_unsupported_rope_and_sliding_window_refuse_to_load(arch, changes, message, tiny_checkpoint, tmp_path):
    path = with_config(tiny_checkpoint, tmp_path, arch, **changes)
    with pytest.raises(ModelLoadError, match=message):  # the loader names the checkpoint before the reason
        Engine.from_pretrained(str(path), device="cpu", dtype="float32")


def test_unused_sliding_window_and_text_mrope_keys_load(tiny_checkpoint, tmp_path):
    """Qwen's `use_sliding_window: false` leaves the window size unused; mRoPE sections are plain RoPE on text."""
    qwen3 = with_config(tiny_checkpoint, tmp_path, "qwen3", use_sliding_window=False, sliding_window=4096)
    ids = random_ids(20, seed=1)
    ref = hf_logits(tiny_checkpoint("qwen3")[1], ids)
    assert (make_engine(qwen3).score(ids) - ref).abs().max().item() < 1e-4
    rope = dict(rope_type="default", rope_theta=1e6, mrope_section=[4, 6, 6], mrope_interleaved=True)
    mrope = with_config(tiny_checkpoint, tmp_path / "mrope", "qwen3", rope_parameters=rope)
    assert (make_engine(mrope).score(ids) - ref).abs().max().item() < 1e-4
