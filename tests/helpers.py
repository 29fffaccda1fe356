"""Helpers shared by test modules: tiny random-weight checkpoints written by transformers' save_pretrained, the
engine settings of the CPU parity tests, transformers' greedy reference, random inputs, and benchmarks/ scripts run
as their users run them.
The pytest fixtures that use them are in tests/conftest.py."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.compile.saved import saves_compiles
from server.kernels import compat

# What torch's CPU build has from 2.13 on (the suite's torch); on older ones (the GPU machine's 2.11) the tests that
# need it skip, from 2.13 on they must pass.
needs_cpu_scaled_mm = pytest.mark.skipif(compat.torch_version() < (2, 13),
                                         reason="torch < 2.13 has no row-wise scaled_mm on the CPU")
needs_saved_compiles = pytest.mark.skipif(not saves_compiles(),
                                          reason=f"torch {torch.__version__} saves no compiled step (saves_compiles)")

ROOT = Path(__file__).resolve().parents[1]

# Small chunks and blocks so prompts span several prefill chunks and KV blocks.
ENGINE_KW = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4, max_num_seqs=8,
                 kv_cache_memory_bytes=8 << 20)


def make_engine(path, **kw):
    from server.engine.engine import Engine

    return Engine.from_pretrained(str(path), **{**ENGINE_KW, **kw})


def replan(monkeypatch, eager: dict | None = None, compiled: dict | None = None) -> None:
    """Engines built from now on run these plans: the engine's own (build.step_plans) with the given fields of
    its eager and of its compiled plans (both compiled ones) changed."""
    import dataclasses

    from server.engine import build
    from server.kernels.plan import StepPlans

    own = build.step_plans

    def plans(device, dtype) -> StepPlans:
        base = own(device, dtype)
        changed = {"eager": eager or {}, "compiled": compiled or {}, "compiled_layers_inline": compiled or {}}
        return StepPlans(**{name: dataclasses.replace(getattr(base, name), **changes)
                            for name, changes in changed.items()})

    monkeypatch.setattr(build, "step_plans", plans)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf_model, ids: list[int], num_new: int) -> list[int]:
    # No EOS for transformers either (min_new_tokens would mask EOS logits and change the argmax).
    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id, config.pad_token_id = 10**6, 0  # an id outside the vocab: never produced
    config.max_new_tokens, config.do_sample = num_new, False
    input_ids = torch.tensor([ids])  # an explicit mask: pad_token_id 0 must not mask prompt tokens equal to 0
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return out[0, len(ids):].tolist()


def merged_state(path) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) safetensors checkpoint directory."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def write_byte_tokenizer(model_dir: Path, eos_token_id: int = 2, added_tokens: tuple[str, ...] = ()) -> None:
    """A 256-token byte-level BPE with no merges: ids match the tiny models' vocab of 256. `added_tokens` take ids
    256, 257, ... (an eos_token_id among them names one)."""
    tok = byte_tokenizer(added_tokens)
    tok.save(str(model_dir / "tokenizer.json"))
    eos = tok.id_to_token(eos_token_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def byte_tokenizer(added_tokens: tuple[str, ...] = ()):
    """The byte-level BPE of write_byte_tokenizer (a `tokenizers.Tokenizer`), `added_tokens` from id 256 on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


# Qwen2.5-Coder's end-of-text, fill-in-the-middle and repository tokens, in its order
QWEN_CODER_TOKENS = ("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                     "<|repo_name|>", "<|file_sep|>")


def build_tiny_fim(out_dir: Path, seed: int = 0):
    """A tiny random qwen3 whose byte tokenizer carries Qwen2.5-Coder's FIM tokens (ids 256-262; EOS
    <|endoftext|>). Returns the HF model (fp32, eval)."""
    cfg_cls, model_cls, kwargs = tiny_configs()["qwen3"]
    cfg = cfg_cls(**{**kwargs, "vocab_size": 256 + len(QWEN_CODER_TOKENS), "eos_token_id": 256})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    write_byte_tokenizer(out_dir, eos_token_id=256, added_tokens=QWEN_CODER_TOKENS)
    return model


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if "expert_bias" in name:
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))


C = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def tiny_configs() -> dict:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(C, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64))),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(C, intermediate_size=128, num_hidden_layers=2, head_dim=32,
            rope_parameters=dict(rope_type="default", rope_theta=1e6))),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(C, **MOE, intermediate_size=128, num_hidden_layers=3,
            head_dim=32, norm_topk_prob=True, mlp_only_layers=[0], rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    }


def build_tiny(model_type: str, out_dir: Path, seed: int = 0, max_shard_size: str = "200KB", **overrides):
    """Random-weight HF model saved (sharded) to out_dir with a byte tokenizer. Returns the HF model (fp32, eval)."""
    cfg_cls, model_cls, kwargs = tiny_configs()[model_type]
    cfg = cfg_cls(**{**kwargs, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    write_byte_tokenizer(out_dir, eos_token_id=cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 2)
    return model


def tiny_hybrid_configs() -> dict:
    """Tiny configs of the hybrid architectures (tie_word_embeddings=True for the LFM2 family, as the real ones)."""
    import transformers as tf

    hyb = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4)  # dk != dv: layout bugs show
    mrope = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                 mrope_interleaved=True, mrope_section=[2, 1, 1])
    lt = ["conv", "full_attention", "conv", "full_attention"]
    next_kw = dict(C, **hyb, **MOE, intermediate_size=128, shared_expert_intermediate_size=MOE["moe_intermediate_size"],
                   norm_topk_prob=True, rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
    lfm = dict(C, tie_word_embeddings=True, num_hidden_layers=4, conv_L_cache=3, layer_types=lt,
               rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return {
        "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM, dict(lfm, intermediate_size=128, block_auto_adjust_ff_dim=True,
                                                         block_multiple_of=32)),
        "lfm2_moe": (tf.Lfm2MoeConfig, tf.Lfm2MoeForCausalLM, dict(lfm, **MOE, intermediate_size=128,
                     num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True)),
        "qwen3_5_text": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(C, **hyb, intermediate_size=128,
                         rope_parameters=mrope)),
        "qwen3_5_moe_text": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(C, **hyb, **MOE,
                             shared_expert_intermediate_size=MOE["moe_intermediate_size"], rope_parameters=mrope)),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, next_kw),
        # a shared expert wider than the routed ones: kept beside them, not as their last slot
        "qwen3_next_wide_shared": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,
                                   dict(next_kw, shared_expert_intermediate_size=2 * MOE["moe_intermediate_size"])),
    }


def randomize_hybrid(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and expert_bias random (none at its default). Weights stay at a realistic scale: the
    chunked and recurrent delta rule round differently, and 0.15-std weights amplify fp32 rounding so much
    that transformers' own chunked-cache and full forwards differ by 2e-4."""
    gen = torch.Generator().manual_seed(seed)
    zero_centered = type(model).__name__.startswith("Qwen3")

    def randn(shape, std):
        return std * torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                param.copy_(randn(param.shape, 0.5))
            elif "norm" in name:  # zero-centred norms store offsets; the GDN output norm is plain
                plain = not zero_centered or name.endswith("linear_attn.norm.weight")
                param.copy_((1.0 if plain else 0.0) + randn(param.shape, 0.1))
            elif "conv" in name:
                param.copy_(randn(param.shape, 0.3))
            elif "embed" in name:
                param.copy_(randn(param.shape, 0.3))
            else:
                param.copy_(randn(param.shape, 0.05))
        for name, buf in model.named_buffers():
            if "expert_bias" in name:
                buf.copy_(randn(buf.shape, 0.5))


def build_tiny_hybrid(arch: str, out_dir: Path):
    """Random-weight hybrid saved by save_pretrained (per-expert and sharded) with a byte tokenizer. Returns the HF
    model (fp32, eval)."""
    cfg_cls, model_cls, kwargs = tiny_hybrid_configs()[arch]
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    randomize_hybrid(model, seed=len(arch))
    model.save_pretrained(out_dir, max_shard_size="200KB")
    write_byte_tokenizer(out_dir)
    return model


SPECIAL_PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "\n"]
MULTIBYTE = "éèüßñøæœçâ中文字语言模型测试你好世界日本語한국어😀🙂🚀🎉👍🏽👨‍👩‍👧🇫🇷∑≈→€£ıİ"


def random_text(rng: random.Random, max_len: int = 60) -> str:
    """Mixed ASCII, accented, CJK, emoji (incl. ZWJ and flag sequences), rare code points, special tokens."""
    pieces = []
    for _ in range(rng.randint(0, max_len)):
        kind = rng.random()
        if kind < 0.45:
            pieces.append(rng.choice("abcdefghijklmnopqrstuvwxyz ABCXYZ  ,.!?'\"-:;()[]{}0123456789\t"))
        elif kind < 0.75:
            pieces.append(rng.choice(MULTIBYTE))
        elif kind < 0.85:
            pieces.append(rng.choice(["the", " model", " token", "ing", " Hello", "  ", "\n\n", "'s", " 42"]))
        elif kind < 0.93:
            pieces.append(rng.choice(SPECIAL_PIECES))
        else:  # any code point outside the surrogate range
            code = rng.choice([rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0xFFFC), rng.randint(0x10000, 0x10FFFF)])
            pieces.append(chr(code))
    return "".join(pieces)


def blockwise_quantize(weight: torch.Tensor, block: int):
    """Hugging Face `quant_method: fp8` form: e4m3 weight and one `weight_scale_inv` per block x block tile."""
    from server.kernels.fp8 import FP8_DTYPE

    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(weight.shape, dtype=FP8_DTYPE)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(FP8_DTYPE)
    return q, scale


def write_blockwise_fp8_checkpoint(src: Path, path: Path, block: int) -> Path:
    """A copy of checkpoint `src` with every projection in block-wise FP8 (one safetensors file)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, path)
    state = {}
    for name, tensor in merged_state(src).items():
        if name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"] = blockwise_quantize(tensor, block)
        else:
            state[name] = tensor
    for file in path.glob("*.safetensors*"):
        file.unlink()
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block], "fmt": "e4m3"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """benchmarks/SCRIPT run as its users run it, `PYTHONPATH=. python3 benchmarks/SCRIPT ARGS` from the repository
    root (the scripts are not a package the tests import); fails the test, with the script's output, unless it
    exits 0."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done
