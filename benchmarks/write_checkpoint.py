"""Write a preset's random-weight model to disk as a Hugging Face checkpoint (transformers' tensor names,
safetensors shards of at most 2 GB, config.json, the demo's tokenizer), so that a start can be measured as `serve`
starts a real model: weights streamed from disk, not generated on the device.

    python3 benchmarks/write_checkpoint.py --preset llama-3.1-8b --out /tmp/ckpt-llama [--dtype bfloat16]

The values are the benchmark's random weights (server.bench.random_model), the tensor names those of
transformers' model of the same config built on the meta device (no memory)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

SHARD_BYTES = 2 << 30
# Run as a script, this folder comes first on sys.path, and its kernels.py would shadow the `kernels` package
# transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    import transformers
    from safetensors.torch import save_file

    from server.bench.presets import load_preset
    from server.bench.random_model import OurWeights
    from server.engine.demo import write_demo_model

    hf_config = load_preset(args.preset).hf_config
    dtype = getattr(torch, args.dtype)
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    ours = OurWeights(hf_config, dtype, torch.device("cpu"), args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(args.out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name in hf_model.state_dict():
        value = ours.value_for(name)
        if value is None:
            continue  # computed buffers (RoPE): transformers builds them itself
        shard[name] = value.to(dtype).contiguous().clone()  # a row block of a fused tensor: its own storage
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (args.out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    (args.out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": args.dtype}, indent=1))
    with tempfile.TemporaryDirectory() as demo:
        write_demo_model(Path(demo))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(demo) / name, args.out / name)
    print(json.dumps({"preset": args.preset, "out": str(args.out), "files": len(set(weight_map.values())),
                      "tensors": len(weight_map)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
