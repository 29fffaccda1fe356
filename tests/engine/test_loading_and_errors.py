"""Weight loading variants and bad inputs: each error says what to fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from server.engine.engine import Engine
from server.engine.types import ContextLengthExceededError, InvalidRequestError, ModelLoadError, SamplingParams
from tests.helpers import ENGINE_KW, merged_state, random_ids


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engine(llama):
    return Engine.from_pretrained(str(llama[0]), **ENGINE_KW)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_single_file(path, state) -> None:
    for file in path.glob("*.safetensors*"):
        file.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
        (SamplingParams(logprobs=50), "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(engine, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.inputs.make_request([1, 2, 3], params)
    assert info.value.param == field and field in str(info.value)


def test_empty_prompt_and_out_of_vocab_ids(engine):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.inputs.make_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.inputs.make_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.inputs.make_request([1, 300], SamplingParams())


def test_prompt_longer_than_context(llama):
    engine = Engine.from_pretrained(str(llama[0]), **{**ENGINE_KW, "max_model_len": 32})
    with pytest.raises(ContextLengthExceededError) as info:
        engine.inputs.make_request(random_ids(40, 1), SamplingParams())
    assert "maximum context length is 32 tokens" in str(info.value) and "40 tokens" in str(info.value)
    # A prompt that fits is capped at the limit instead of failing.
    out = engine.generate(random_ids(28, 1), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert out.completion_tokens == 4 and out.finish_reason == "length"
    # from_pretrained's flat overrides land in their sections; the scheduler holds its section, the length resolved
    assert engine.config.scheduler.max_model_len == 32 and engine.config.cache.block_size == ENGINE_KW["block_size"]
    assert engine.scheduler.config == engine.config.scheduler


def test_from_pretrained_names_an_unknown_override(llama):
    with pytest.raises(TypeError, match=r"unknown EngineConfig settings \['max_num_seq'\]"):
        Engine.from_pretrained(str(llama[0]), max_num_seq=4)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="not a directory|neither a local directory"):
        Engine.from_pretrained("/nonexistent/model/dir", device="cpu")


def test_corrupt_safetensors_names_the_file(llama, tmp_path):
    path = copy_checkpoint(llama[0], tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\x00" * 32)
    with pytest.raises(ModelLoadError, match=f"{shard.name}.*corrupt"):
        Engine.from_pretrained(str(path), **ENGINE_KW)


def test_missing_tensor_and_shape_mismatch_are_named(llama, tmp_path):
    state = merged_state(llama[0])
    path = copy_checkpoint(llama[0], tmp_path / "missing")
    rewrite_single_file(path, {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        Engine.from_pretrained(str(path), **ENGINE_KW)
    path = copy_checkpoint(llama[0], tmp_path / "shape")
    bad = dict(state, **{"model.norm.weight": torch.ones(65)})
    rewrite_single_file(path, bad)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\[65\].*\[64\]"):
        Engine.from_pretrained(str(path), **ENGINE_KW)


def test_unsupported_model_type_and_pickles_refused(llama, tmp_path):
    path = copy_checkpoint(llama[0], tmp_path / "gpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, model_type="gpt_bigcode")))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_bigcode'"):
        Engine.from_pretrained(str(path), **ENGINE_KW)
    path = copy_checkpoint(llama[0], tmp_path / "pickle")
    for file in path.glob("*.safetensors*"):
        file.unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are never loaded"):
        Engine.from_pretrained(str(path), **ENGINE_KW)


def test_single_file_and_fused_expert_layout_load_identically(tiny_checkpoint, tmp_path):
    src, hf_model = tiny_checkpoint("qwen3_moe")
    state = merged_state(src)
    fused = {}
    for name, tensor in state.items():
        if ".experts." not in name:
            fused[name] = tensor
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"]]) for e in range(8)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    path = copy_checkpoint(src, tmp_path / "fused")
    rewrite_single_file(path, fused)
    ids = random_ids(20, 3)
    ours = Engine.from_pretrained(str(path), **ENGINE_KW).score(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_hub_repo_id_from_a_hand_made_offline_cache(llama, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(llama[0], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = (
        "from server.engine.weights import resolve_model_path; from server.engine.engine import Engine;"
        "p = resolve_model_path('tiny-org/tiny-llama'); print(p);"
        "e = Engine.from_pretrained('tiny-org/tiny-llama', device='cpu', kv_cache_memory_bytes=1<<20);"
        "print(e.generate([1, 2, 3], __import__('server').SamplingParams(max_tokens=2, temperature=0)).completion_tokens)"
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0].endswith(f"snapshots/{commit}") and lines[-1] == "2"
    code = "from server.engine.weights import resolve_model_path; resolve_model_path('tiny-org/not-cached')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not in the Hugging Face cache" in done.stderr


@pytest.mark.parametrize("missing", ["model.layers.2.mlp.shared_expert.up_proj.weight",
                                     "model.layers.0.mlp.experts.3.down_proj.weight"])
def test_a_missing_shared_or_routed_expert_tensor_is_named(missing, hybrid_checkpoint, tmp_path):
    """Qwen3-Next keeps its shared expert as the experts' last slot; a checkpoint without one of its tensors (or
    a routed expert's) is refused with the checkpoint's own name for it."""
    path, _ = hybrid_checkpoint("qwen3_next")
    state = merged_state(path)
    assert missing in state
    path = copy_checkpoint(path, tmp_path / "missing")
    rewrite_single_file(path, {k: v for k, v in state.items() if k != missing})
    with pytest.raises(ModelLoadError, match=f"missing tensors: {missing.replace('.', '[.]')}$"):
        Engine.from_pretrained(str(path), **ENGINE_KW)
