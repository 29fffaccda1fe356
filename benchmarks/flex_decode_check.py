"""Is the compiled FlexAttention decode right on this GPU, and how long does one layer's decode attention take
with each form? (The CPU tests check the eager form; the fused kernel exists only on CUDA.)

    PYTHONPATH=. python3 benchmarks/flex_decode_check.py [--block-sizes 16,64]

Correctness: compiled flex vs the fp32 reduce form on random caches (several batch sizes and positions, bf16).
Timing: one CUDA graph holding 32 layers' decode attention (Llama-3.1-8B heads: 32 q, 8 kv, dim 128) for the
compiled sdpa and flex forms at a 256-token context; microseconds per layer.
"""

from __future__ import annotations

import argparse
import json

import torch

from server.bench.measure import cuda_graph_us
from server.kernels.flex_decode import decode_block_mask, flex_decode_attention
from server.kernels.paged_attention import paged_attention, paged_decode_attention
from server.models.base import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 8, 128, 32


def random_case(batch: int, block_size: int, num_blocks: int, max_len: int, gen: torch.Generator, device):
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    max_blocks = -(-max_len // block_size)
    blocks = (torch.randperm(num_blocks - 1, generator=gen)[: batch * max_blocks] + 1).view(batch, max_blocks)
    positions = torch.randint(0, max_len, (batch,), generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    return q, k_cache, v_cache, blocks.to(device), positions.to(device)


def layers_step(kind: str, caches):
    def step(q, tables, positions):
        slots = torch.zeros_like(positions)  # unused: decode attention does not write
        meta = AttentionMetadata.for_decode(slots, tables, positions, kind, caches[0])
        out = q
        for k_cache, v_cache in caches:
            out = paged_attention(out, out, out, k_cache, v_cache, meta, HEAD_DIM**-0.5)
        return out
    return torch.compile(step, fullgraph=True)


def check(block_size: int, device) -> list[dict]:
    gen = torch.Generator().manual_seed(block_size)
    compiled = torch.compile(lambda q, k, v, t, p: flex_decode_attention(
        q, k, v, decode_block_mask(t, p, block_size, k.shape[0] * block_size), HEAD_DIM**-0.5), fullgraph=True)
    rows = []
    for batch, max_len in [(1, 1), (1, 300), (4, 77), (16, 1000), (3, 4096)]:
        torch._dynamo.reset()  # each batch size static, as DecodeGraphs compiles it (the kernel needs that)
        q, k_cache, v_cache, tables, positions = random_case(batch, block_size, 2048, max_len, gen, device)
        ref = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, positions, HEAD_DIM**-0.5)
        out = compiled(q, k_cache, v_cache, tables, positions).float()
        rows.append({"block_size": block_size, "batch": batch, "max_len": max_len,
                     "max_abs_err": round((out - ref).abs().max().item(), 5)})
    return rows


def time_layers(kind: str, block_size: int, batch: int, context: int, device) -> float:
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, tables, _ = random_case(batch, block_size, 4096, context, gen, device)
    positions = torch.full((batch,), context - 1, device=device)
    caches = [(k_cache, v_cache)] * NUM_LAYERS
    step = layers_step(kind, caches)
    return cuda_graph_us(lambda: step(q, tables, positions), warmups=3, replays=50) / NUM_LAYERS


def engine_parity(device) -> dict:
    """A tiny random Llama in fp32: the compiled flex decode (CUDA graphs, batch buckets 1, 2, 4 and growing
    contexts) gives the eager engine's greedy tokens."""
    from server.bench.presets import load_preset
    from server.bench.random_model import build_random_model
    from server.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.types import SamplingParams

    hf_config = dict(load_preset("llama-3.1-8b").hf_config, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000)
    model = build_random_model(hf_config, device, torch.float32, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 40, 17, 90)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    result = {}
    for kind in ("off", "flex", "sdpa"):
        config = EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=64 << 20,
                              compile="off" if kind == "off" else "on", decode_attention="sdpa" if kind == "off" else kind,
                              enable_prefix_caching=False)
        engine = Engine.from_model(model, config, device)
        result[kind] = [[o.token_ids for o in engine.generate(prompts[:n], params)] for n in (1, 2, 3, 4)]
    return {"engine_parity_flex": result["flex"] == result["off"], "engine_parity_sdpa": result["sdpa"] == result["off"]}


def diagnose(device) -> None:
    """Which part goes wrong when compiled: one variant per line, each against the fp32 reduce form."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import server.kernels.flex_decode as fd

    scale = HEAD_DIM**-0.5
    for block_size in (16, 64):
        gen = torch.Generator().manual_seed(5)
        q, k_cache, v_cache, tables, positions = random_case(2, block_size, 256, 150, gen, device)
        ref = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, positions, scale)
        num_slots = k_cache.shape[0] * block_size

        def paged(q, k, v, t, p, options=None, contiguous=False, simple_mask=False, block_size=block_size,
                  num_slots=num_slots):
            mask = fd.decode_block_mask(t, p, block_size, num_slots)
            if simple_mask:  # right on the listed blocks only: the fused kernel never looks elsewhere
                last_physical = t.gather(1, (p // block_size)[:, None])[:, 0]
                mask = fd.BlockMask.from_kv_blocks(
                    mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE, seq_lengths=mask.seq_lengths,
                    mask_mod=lambda b, h, qi, ki: (ki // block_size != last_physical[b]) | (
                        ki % block_size <= p[b] % block_size), compute_q_blocks=False)
            keys = k.view(1, num_slots, KV_HEADS, HEAD_DIM).transpose(1, 2)
            values = v.view(1, num_slots, KV_HEADS, HEAD_DIM).transpose(1, 2)
            if contiguous:
                keys, values = keys.contiguous(), values.contiguous()
            return flex_attention(q.unsqueeze(2), keys, values, block_mask=mask, scale=scale, enable_gqa=True,
                                  kernel_options=options)[:, :, 0]

        def dense(q, k, v, t, p, block_size=block_size):  # no paging: gathered sequences, a plain length mask
            seq_len = t.shape[1] * block_size
            keys = k[t].view(t.shape[0], seq_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
            values = v[t].view(t.shape[0], seq_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
            mask = create_block_mask(lambda b, h, qi, ki: ki <= p[b], t.shape[0], None, 1, seq_len, device=q.device)
            return flex_attention(q.unsqueeze(2), keys, values, block_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]

        block_n = {"BLOCK_N": min(block_size, 64)}
        variants = {
            "paged": lambda *a, o=block_n: paged(*a, options=o),
            "paged_contiguous_kv": lambda *a, o=block_n: paged(*a, options=o, contiguous=True),
            "paged_simple_mask": lambda *a, o=block_n: paged(*a, options=o, simple_mask=True),
            "paged_default_options": lambda *a: paged(*a),
            "paged_main_kernel": lambda *a, o=block_n: paged(*a, options={**o, "BLOCK_M": 16,
                                                                           "FORCE_USE_FLEX_ATTENTION": True}),
            "dense_gathered": dense,
        }
        for name, fn in variants.items():
            try:
                eager = (fn(q, k_cache, v_cache, tables, positions).float() - ref).abs().max().item()
                out = torch.compile(fn, fullgraph=True)(q, k_cache, v_cache, tables, positions).float()
                row = {"eager_err": round(eager, 4), "compiled_err": round((out - ref).abs().max().item(), 4)}
            except Exception as exc:  # a variant torch rejects is an answer too
                row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            print(json.dumps({"block_size": block_size, "variant": name, **row}), flush=True)
        torch._dynamo.reset()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-sizes", default="16,64")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--timed-block-size", default="16", help="time the layers at this cache block size only")
    parser.add_argument("--diagnose", action="store_true", help="only the variants that locate a wrong result")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.diagnose:
        return diagnose(device)
    print(json.dumps(engine_parity(device)), flush=True)
    for block_size in [int(b) for b in args.block_sizes.split(",")]:
        for row in check(block_size, device):
            print(json.dumps(row), flush=True)
        if block_size != int(args.timed_block_size):
            continue
        for batch in [int(b) for b in args.batches.split(",")]:
            for context in (256, 2048):
                times = {kind: round(time_layers(kind, block_size, batch, context, device), 2) for kind in ("sdpa", "flex")}
                print(json.dumps({"block_size": block_size, "batch": batch, "context": context, "us_per_layer": times}),
                      flush=True)


if __name__ == "__main__":
    main()
