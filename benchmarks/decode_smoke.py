"""Quick decode check on a GPU: random-weight model of a real shape, our engine in several modes, steady
decode tok/s = 64 / (t(129 new) - t(65 new)), and a sync check of one decode launch.

python benchmarks/decode_smoke.py --shape llama-3.1-8b --modes eager,compile,graphs
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams
from server.models.registry import get_model_module

SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
}


def build(shape: str, device, dtype):
    config = SHAPES[shape]
    module = get_model_module(config["model_type"])
    args = module.ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = module.Model(args).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02 if "norm" not in name else 0.05)
    for sub in model.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
    return model.eval()


def timed_generate(engine, prompts, num_new):
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--modes", default="eager,compile,graphs")
    parser.add_argument("--batch-sizes", default="1")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = build(args.shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    results = []
    for mode in args.modes.split(","):
        config = EngineConfig(model=args.shape, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096,
                              kv_cache_memory_bytes=8 << 30, compile="off" if mode == "eager" else "on",
                              cuda_graphs=mode == "graphs")
        engine = Engine.from_model(model, config, device)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 1000, (128,), generator=gen).tolist() for _ in range(batch)]
            warm = time.perf_counter()
            timed_generate(engine, prompts, 129)  # compile / capture
            warm = time.perf_counter() - warm
            t65 = min(timed_generate(engine, prompts, 65) for _ in range(2))
            t129 = min(timed_generate(engine, prompts, 129) for _ in range(2))
            tok_s = 64 / (t129 - t65)
            row = dict(shape=args.shape, mode=mode, batch=batch, decode_tok_s_per_seq=round(tok_s, 1),
                       ms_per_step=round(1000 / tok_s, 3), weight_gb=round(weight_bytes / 1e9, 2),
                       achieved_gb_s=round(weight_bytes * tok_s / 1e9, 1), warmup_s=round(warm, 1))
            print(json.dumps(row), flush=True)
            results.append(row)
        if mode != "eager" and engine.runner.decode_graphs is not None:
            check_sync_free(engine)
        del engine
        torch.cuda.empty_cache()


def check_sync_free(engine):
    """One decode launch under sync-debug 'error': raises if anything inside synchronizes with the host."""
    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    request = engine.make_request(list(range(1, 40)), params)
    engine.add_request(request)
    for _ in range(3):  # prefill, first decode (compiles), then a steady decode step checked below
        engine.step()
    out = engine.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.launch(out, engine._in_flight)
        print(json.dumps({"sync_free_decode_launch": True}), flush=True)
    except RuntimeError as exc:
        print(json.dumps({"sync_free_decode_launch": False, "error": str(exc)[:300]}), flush=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
