"""The embedded demo model: deterministic, atomic, re-used, and a real checkpoint for transformers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.engine import demo
from server.engine.demo import DEMO_DIR_NAME, REQUIRED_FILES, ensure_demo_model
from server.engine.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"


def file_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_written_twice_byte_identical(demo_dir, tmp_path):
    again = ensure_demo_model(tmp_path)
    assert again == tmp_path / DEMO_DIR_NAME and again != demo_dir
    assert sorted(p.name for p in again.iterdir()) == sorted(REQUIRED_FILES)
    assert file_digests(again) == file_digests(demo_dir)
    assert not [p for p in tmp_path.iterdir() if p.name != DEMO_DIR_NAME]  # no temp dirs left behind


def test_tokenizer_training_is_deterministic_across_processes(demo_dir):
    """A fresh interpreter, another hash seed and a single rayon thread still train the same tokenizer."""
    code = "from server.engine.demo import build_tokenizer; import sys; sys.stdout.write(build_tokenizer().to_str())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True, text=True).stdout
    from tokenizers import Tokenizer as Backend

    assert out == demo.build_tokenizer().to_str()
    assert Backend.from_str(out).to_str(pretty=True) == (demo_dir / "tokenizer.json").read_text(encoding="utf-8")


def test_reused_when_present_and_rebuilt_when_incomplete(demo_dir, tmp_path, monkeypatch):
    target = ensure_demo_model(tmp_path)
    digests = file_digests(target)

    def fail(_out_dir):
        raise AssertionError("the demo model was rewritten although it was complete")

    monkeypatch.setattr(demo, "write_demo_model", fail)
    assert ensure_demo_model(tmp_path) == target
    monkeypatch.undo()

    (target / "model.safetensors").unlink()  # e.g. an interrupted copy by hand
    assert ensure_demo_model(tmp_path) == target
    assert file_digests(target) == digests


def test_a_model_another_writer_completed_meanwhile_is_kept(demo_dir, tmp_path, monkeypatch):
    """Two processes writing the demo at once (the ranks of a parallel model): the one that finishes second keeps
    the first one's files, which that process may be reading already, instead of moving them aside."""
    target = tmp_path / DEMO_DIR_NAME
    write, other_writers = demo.write_demo_model, []

    def write_while_another_completes(out_dir):
        write(out_dir)
        shutil.copytree(demo_dir, target)  # the other writer's rename into place
        other_writers.append((target / "model.safetensors").stat().st_ino)

    monkeypatch.setattr(demo, "write_demo_model", write_while_another_completes)
    assert ensure_demo_model(tmp_path) == target
    assert other_writers == [(target / "model.safetensors").stat().st_ino]
    assert file_digests(target) == file_digests(demo_dir)
    assert not [p for p in tmp_path.iterdir() if p.name != DEMO_DIR_NAME]


def test_env_var_chooses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPS_SERVE_CACHE", str(tmp_path / "env-cache"))
    assert ensure_demo_model() == tmp_path / "env-cache" / DEMO_DIR_NAME
    monkeypatch.delenv("MPS_SERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ensure_demo_model() == tmp_path / "xdg" / "mps-serve" / DEMO_DIR_NAME


def test_config_matches_its_tokenizer(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    tok = Tokenizer.from_pretrained(demo_dir)
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["vocab_size"] == tok.vocab_size and 900 <= tok.vocab_size <= 1100
    assert config["eos_token_id"] == tok.encode("<|im_end|>", add_special_tokens=False)[0]
    assert config["eos_token_id"] in tok.eos_token_ids
    assert tok.chat_template == (TEMPLATES / "qwen3.jinja").read_text()  # the real Qwen3 template
    token_bytes = {tok.token_bytes(i) for i in range(tok.vocab_size)}
    assert {bytes([b]) for b in range(256)} <= token_bytes  # the whole byte alphabet: any text encodes
    ids = tok.encode("中文 🙂 café", add_special_tokens=False)
    assert tok.decode(ids) == "中文 🙂 café"


def test_loads_in_transformers(demo_dir):
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    config = json.loads((demo_dir / "config.json").read_text())
    assert model.config.num_experts == config["num_experts"] and model.config.head_dim == config["head_dim"]
    weights = load_file(demo_dir / "model.safetensors")
    params = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert torch.equal(params[name], weights[name])
    inter = config["moe_intermediate_size"]
    gate_up = params["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, 2 * inter, hidden] fused on load
    for e in range(config["num_experts"]):
        expert = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(gate_up[e, :inter], weights[expert + "gate_proj.weight"])
        assert torch.equal(gate_up[e, inter:], weights[expert + "up_proj.weight"])
        assert torch.equal(params["model.layers.1.mlp.experts.down_proj"][e], weights[expert + "down_proj.weight"])
    assert model.config.rope_parameters["rope_theta"] == config["rope_theta"]
    assert weights["model.embed_tokens.weight"].std() > 0.4 and weights["lm_head.weight"].std() < 0.1
    for w in weights.values():
        assert w.dtype == torch.float32 and w.isfinite().all()

    hf_tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "hi 🙂"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    ours = Tokenizer.from_pretrained(demo_dir)
    assert ours.encode(ours.apply_chat_template(messages), add_special_tokens=False) == ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]  # [vocab]
    assert logits.shape == (ours.vocab_size,) and logits.isfinite().all()
    assert logits.std() > 0.1  # not flat: greedy decoding picks varied tokens
