"""Where does a decode step's time go? torch.profiler over a few steps of the compiled engine.

python benchmarks/decode_profile.py --shape llama-3.1-8b --decode-attention sdpa,reduce
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_smoke import build, timed_generate
from server.config import EngineConfig
from server.engine.engine import Engine
from server.engine.types import SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--decode-attention", default="sdpa,reduce")
    parser.add_argument("--graphs", default="1")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build(args.shape, device, torch.bfloat16)
    prompts = [list(range(1, 129))] * args.batch
    for kernel in args.decode_attention.split(","):
        config = EngineConfig(model=args.shape, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096,
                              kv_cache_memory_bytes=8 << 30, compile="on", cuda_graphs=args.graphs == "1",
                              decode_attention=kernel)
        engine = Engine.from_model(model, config, device)
        start = time.perf_counter()
        timed_generate(engine, prompts, 129)
        warm = time.perf_counter() - start
        t65 = min(timed_generate(engine, prompts, 65) for _ in range(2))
        t129 = min(timed_generate(engine, prompts, 129) for _ in range(2))
        print(json.dumps(dict(shape=args.shape, decode_attention=kernel, batch=args.batch, graphs=args.graphs,
                              tok_s=round(64 / (t129 - t65), 1), warmup_s=round(warm, 1))), flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
