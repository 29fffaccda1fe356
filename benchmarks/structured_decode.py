"""Constrained decode (response_format json_schema) vs unconstrained, side by side in one run, on a preset's
random-weight model: per batch size, the tok/s of a batch of plain requests, of a batch of constrained ones, and
of a mixed batch (half each, the plain half's rate reported apart); rates per row.

    PYTHONPATH=. python3 benchmarks/structured_decode.py --preset llama-3.1-8b --batch-sizes 1,16 \\
        --tokenizer /path/to/Llama-3.1-8B-Instruct [--schema schema.json] [--max-tokens 256]

`--tokenizer` is a checkpoint directory with the preset's tokenizer.json: the mask's cost grows with the
vocabulary, so measure with the real one. Without it a synthetic byte-level BPE of the model's vocabulary size
stands in (benchmarks/synthetic_tokenizer.py; its tokens are longer on average than real ones). Random weights
keep strings going, so constrained rows usually run to --max-tokens like the plain ones. Each mode is timed --reps
times, interleaved with the others, and its fastest run counts. Prints one JSON line per batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace

from synthetic_tokenizer import write_synthetic_tokenizer

NESTED_SCHEMA = {  # a typical nested response: objects in an array, enums, numbers, free strings
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "qty": {"type": "integer"},
                           "kind": {"enum": ["tool", "part", "other"]}, "price": {"type": "number"}},
            "required": ["name", "qty", "kind"]}},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["title", "items"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--tokenizer", help="checkpoint directory holding the preset's tokenizer.json")
    parser.add_argument("--schema", help="a JSON schema file (default: a nested object schema)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--num-layers", type=int, help="cut the preset to its first N layers (a quick check)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per mode, interleaved; the fastest counts")
    args = parser.parse_args(argv)

    import torch

    from server.bench.presets import load_preset, with_num_layers
    from server.bench.random_model import build_random_model
    from server.config import EngineConfig
    from server.engine import device as device_mod
    from server.engine.engine import Engine
    from server.engine.tokenizer import Tokenizer
    from server.engine.types import SamplingParams, StructuredOutput

    schema = json.loads(open(args.schema).read()) if args.schema else NESTED_SCHEMA
    hf_config = load_preset(args.preset).hf_config
    if args.num_layers:
        hf_config = with_num_layers(hf_config, args.num_layers)
    if args.tokenizer is None:
        args.tokenizer = write_synthetic_tokenizer(tempfile.mkdtemp(), hf_config["vocab_size"])
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    device, _ = device_mod.select_device("auto")
    dtype = device_mod.select_dtype("auto", device, hf_config.get("torch_dtype"))
    model = build_random_model(hf_config, device, dtype, 0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = EngineConfig.from_flat(model=args.preset, device=device.type, max_num_seqs=max(batch_sizes))
    engine = Engine.from_model(model, config, device, tokenizer=tokenizer, max_model_len=4096)
    if tokenizer.vocab_size > engine.vocab_size:
        parser.error(f"the tokenizer's {tokenizer.vocab_size} ids do not fit the model's {engine.vocab_size} logits")
    # No warm-up of every (batch, KV length) bucket: each mode's first, untimed run compiles only what it uses.
    log(f"{args.preset} built; vocabulary {tokenizer.vocab_size}")
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                 structured=StructuredOutput.from_json_schema(schema))
    prompt_vocab = min(tokenizer.vocab_size, engine.vocab_size)

    def run(kinds: list[SamplingParams]) -> tuple[float, list]:
        prompts = torch.randint(0, prompt_vocab, (len(kinds), args.prompt_len)).tolist()
        requests = [engine.make_request(p, replace(k, seed=i)) for i, (p, k) in enumerate(zip(prompts, kinds,
                                                                                                  strict=True))]
        start = time.perf_counter()
        outs = engine.run_to_completion(requests)
        return time.perf_counter() - start, outs

    def per_row_rate(seconds: float, outs: list) -> float:
        return round(sum(o.completion_tokens for o in outs) / seconds / len(outs), 1)

    for batch in batch_sizes:
        modes = {"unconstrained": [plain] * batch, "constrained": [constrained] * batch,
                 "mixed": [constrained if i % 2 else plain for i in range(batch)]}
        row = {"preset": args.preset, "device": device.type, "torch_version": torch.__version__, "batch": batch,
               "max_tokens": args.max_tokens, "vocab_size": tokenizer.vocab_size}
        for kinds in modes.values():
            run(kinds)  # warm: the sampler compiled with the bitmask, the mask's first states
        best: dict[str, tuple[float, list]] = {}
        for _ in range(args.reps):  # interleaved, so a slow spell of the host hits every mode alike
            for name, kinds in modes.items():
                seconds, outs = run(kinds)
                log(f"batch {batch} {name}: {seconds:.2f} s")
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, outs)
        for name, (seconds, outs) in best.items():
            row[f"{name}_tok_s_per_row"] = per_row_rate(seconds, outs)
            if name == "mixed" and batch > 1:  # the plain half, to compare with an all-plain batch
                row["mixed_unconstrained_tok_s_per_row"] = per_row_rate(seconds, outs[0::2])
            row[f"{name}_finish"] = sorted({o.finish_reason for o in outs})
        base = row["unconstrained_tok_s_per_row"]
        row["constrained_vs_unconstrained"] = round(row["constrained_tok_s_per_row"] / base, 3)
        if batch > 1:
            row["mixed_unconstrained_vs_unconstrained"] = round(row["mixed_unconstrained_tok_s_per_row"] / base, 3)
        print(json.dumps(row), flush=True)
    return 0


def log(text: str) -> None:
    """Progress on stderr, so a run cut off by a time limit still says how far it got."""
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
