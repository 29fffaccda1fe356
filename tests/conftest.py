"""Shared fixtures: tiny random-weight checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def write_byte_tokenizer(model_dir: Path, eos_token_id: int = 2) -> None:
    """A 256-token byte-level BPE with no merges: ids match the tiny models' vocab of 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model_dir / "tokenizer.json"))
    eos = next(ch for ch, i in vocab.items() if i == eos_token_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: (model_type) -> (path, hf_model), cached per session."""
    cache: dict = {}

    def make(model_type: str):
        if model_type not in cache:
            path = tmp_path_factory.mktemp(model_type)
            cache[model_type] = (path, build_tiny(model_type, path))
        return cache[model_type]

    return make


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled code: dynamo keeps its graphs per code object, so engines built by
    earlier tests (same forward functions, other instances) would count against its recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
