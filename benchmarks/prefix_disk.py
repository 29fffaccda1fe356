"""The prefix cache's disk tier (issue 62): time to first token of a long conversation's next turn served from disk,
against a cold prefill of the same prompt, and decode speed while the tier writes.

Scenarios, each on random token ids of `--context` tokens plus `--turn` new tokens per turn (greedy, one token
generated for a TTFT):
  evicted     conversation A, then B of the same length in KV memory that holds one: A's blocks go to disk;
              A's next turn reads them back                                     -> TTFT / cold TTFT (target <= 15%)
  restart     the engine saves its cache and a new engine on the same model starts; A's next turn again
                                                                                -> TTFT / cold TTFT (target <= 15%)
  alternate   A and B take turns (`--rounds` each) with KV memory for one       -> each turn / cold (target <= 20%)
  decode      tokens/s of one decoding sequence while the writer drains a queue of evicted blocks, against the
              same decode with the writer idle                                  -> ratio (target >= 98%)
"cold" is an engine without prefix caching on the same model. Files are read through the OS page cache, warm
after their writes: a cold SSD read adds its latency (drop the page cache between phases to measure it).

    PYTHONPATH=. python3 benchmarks/prefix_disk.py --preset qwen3-30b-a3b --context 32000 --json disk.jsonl
    PYTHONPATH=. python3 benchmarks/prefix_disk.py --preset qwen3.6-35b-a3b --context 32000   # hybrid states
    PYTHONPATH=. python3 benchmarks/prefix_disk.py --device cpu --preset qwen3-8b --num-layers 4 --context 2048 \\
        --override hidden_size=512 intermediate_size=1536 num_attention_heads=8 head_dim=64 vocab_size=4096

A preset gets random weights (server.bench.random_model); `--override KEY=VALUE` changes its config (a CPU-sized
run of a real architecture); `--engine-option KEY=VALUE` sets an EngineConfig field.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time

import torch

from server.bench.measure import synchronize
from server.bench.options import engine_option
from server.bench.presets import load_preset, with_num_layers
from server.bench.run import device_name, random_prompts
from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.model_runner import KVCache
from server.engine.types import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (default: qwen3-30b-a3b)")
    parser.add_argument("--num-layers", type=int, default=None, help="cut the preset to its first N layers")
    parser.add_argument("--override", nargs="*", type=engine_option, default=[], metavar="KEY=VALUE",
                        help="change the preset's config (hidden_size=512 ...)")
    parser.add_argument("--device", default="auto", help="auto | cuda | mps | cpu (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (default: auto)")
    parser.add_argument("--context", type=int, default=32000, help="tokens of the conversation so far (32000)")
    parser.add_argument("--turn", type=int, default=64, help="new tokens per turn (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per conversation when alternating (3)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens of the decode measure (128)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default: 16)")
    parser.add_argument("--cache-dir", default=None, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--engine-option", action="append", type=engine_option, default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field, e.g. compile=off (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="append the records to this JSON Lines file")
    return parser.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace, cache_dir: str):
        from server.bench.random_model import build_random_model

        hf_config = load_preset(args.preset).hf_config
        if args.num_layers:
            hf_config = with_num_layers(hf_config, args.num_layers)
        self.hf_config = dict(hf_config, **dict(args.override))
        self.device, _ = device_mod.select_device(args.device)
        self.dtype = device_mod.select_dtype(args.dtype, self.device, self.hf_config.get("torch_dtype"))
        self.model = build_random_model(self.hf_config, self.device, self.dtype, args.seed)
        self.args, self.cache_dir = args, cache_dir
        self.vocab = int(self.hf_config["vocab_size"])
        per_block = KVCache.bytes_per_block(self.model.kv_cache_shapes(), args.block_size, self.dtype)
        longest = args.context + (args.rounds + 2) * (args.turn + 1) + args.decode_tokens
        self.max_len = longest + args.block_size
        # KV memory for one conversation: a second one evicts the first
        self.kv_bytes = (-(-self.max_len // args.block_size) + 4) * per_block

    def engine(self, disk: bool):
        from server.engine.engine import Engine

        settings = dict(device=self.device.type, dtype=str(self.dtype).removeprefix("torch."), max_num_seqs=1,
                        max_model_len=self.max_len, block_size=self.args.block_size,
                        kv_cache_memory_bytes=self.kv_bytes, **dict(self.args.engine_option))
        settings.update(dict(prefix_cache_dir=self.cache_dir) if disk else dict(enable_prefix_caching=False))
        engine = Engine.from_model(self.model, EngineConfig.from_flat(model=self.args.preset, **settings), self.device)
        engine.generate(self.prompt(97, 64), ONE)  # kernels warm (and the cache holds nothing we time)
        return engine

    def prompt(self, seed: int, length: int) -> list[int]:
        return random_prompts(1, length, self.vocab, self.args.seed * 1000 + seed)[0]

    def ttft(self, engine, prompt: list[int]) -> tuple[float, int, int]:
        """-> (seconds to the first token, cached tokens, of them from disk)."""
        before = engine.stats().prefix_cache_disk_hit_tokens
        synchronize(self.device)
        start = time.perf_counter()
        out = engine.generate(prompt, ONE)
        synchronize(self.device)
        return time.perf_counter() - start, out.cached_tokens, engine.stats().prefix_cache_disk_hit_tokens - before

    def decode_rate(self, engine, seed: int, write: bool) -> tuple[float, int]:
        """Tokens/s of one sequence generating `--decode-tokens` after a 16-token prompt (its prefill included);
        `write`: before every step the writer's queue is topped up with cached blocks the disk lacks (as the
        idle write-behind leaves it when a request arrives). -> (tokens/s, bytes the tier wrote meanwhile)."""
        params = SamplingParams(max_tokens=self.args.decode_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(engine.inputs.make_request(self.prompt(seed, 16), params))
        written = engine.kv_manager.disk.index.total_bytes
        synchronize(self.device)
        start = time.perf_counter()
        while engine.has_unfinished:
            if write:
                engine.kv_manager.save_to_disk()
            engine.step()
        synchronize(self.device)
        rate = self.args.decode_tokens / (time.perf_counter() - start)
        return rate, engine.kv_manager.disk.index.total_bytes - written


def run(args: argparse.Namespace, cache_dir: str) -> list[dict]:
    bench = Bench(args, cache_dir)
    cold, tier = bench.engine(disk=False), bench.engine(disk=True)
    records: list[dict] = []

    def record(scenario: str, prompt: list[int], engine) -> dict:
        seconds, cached, from_disk = bench.ttft(engine, prompt)
        cold_s, _, _ = bench.ttft(cold, prompt)
        row = dict(scenario=scenario, prompt_tokens=len(prompt), ttft_s=round(seconds, 4), cold_ttft_s=round(cold_s, 4),
                   ratio=round(seconds / cold_s, 4), cached_tokens=cached, disk_tokens=from_disk)
        print(f"{scenario:<10} {len(prompt):>7} tokens  ttft {seconds:8.3f} s  cold {cold_s:8.3f} s  "
              f"ratio {seconds / cold_s:6.1%}  cached {cached} (disk {from_disk})", flush=True)
        records.append(row)
        return row

    a, b = bench.prompt(1, args.context), bench.prompt(2, args.context)
    tier.generate(a, ONE)
    tier.generate(b, ONE)  # evicts A: its blocks go to disk in the background
    start = time.perf_counter()
    tier.kv_manager.disk.io.drain()
    print(f"writes still queued after B's turn drained in {time.perf_counter() - start:.3f} s", flush=True)
    a_next = a + bench.prompt(3, args.turn)
    record("evicted", a_next, tier)

    tier.save_prefix_cache()
    del tier
    restarted = bench.engine(disk=True)
    record("restart", a_next + bench.prompt(4, args.turn), restarted)

    conversations = {"A": a_next, "B": b}
    for turn in range(args.rounds):
        for name in ("A", "B"):
            conversations[name] = conversations[name] + bench.prompt(10 + turn * 2 + (name == "B"), args.turn)
            record(f"alternate-{name}{turn}", conversations[name], restarted)

    restarted.kv_manager.disk.io.drain()
    idle, _ = bench.decode_rate(restarted, 50, write=False)
    for seed in (5, 6):  # conversations memory caches and the disk lacks
        restarted.generate(bench.prompt(seed, args.context), ONE)
    busy, written = bench.decode_rate(restarted, 51, write=True)
    print(f"decode     {idle:8.1f} tok/s idle writer, {busy:8.1f} tok/s writing ({busy / idle:6.1%}), "
          f"{written / 2**20:.1f} MiB written during the decode", flush=True)
    records.append(dict(scenario="decode", idle_tok_s=round(idle, 2), writing_tok_s=round(busy, 2),
                        ratio=round(busy / idle, 4), written_mib=round(written / 2**20, 1)))
    stamp = dict(preset=args.preset, device=device_name(bench.device), dtype=str(bench.dtype),
                 torch=torch.__version__, context=args.context, date=datetime.date.today().isoformat())
    return [dict(stamp, **r) for r in records]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cache_dir is not None:
        records = run(args, args.cache_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="prefix-disk-") as tmp:
            records = run(args, tmp)
    if args.json:
        with open(args.json, "a") as f:
            for row in records:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
